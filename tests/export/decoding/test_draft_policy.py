"""DraftLength: how many drafted tokens a step verifies, from acceptance per source and call prices
(deterministic where priced by the cost line: tests.export.conftest.fixed_policy)."""

from __future__ import annotations

import pytest

from export.decoding.draft_policy import DraftLength
from tests.export.conftest import fixed_policy as _fixed


def test_the_draft_length_follows_acceptance_and_cost():
    # a call of k + 1 tokens costs 1 + 0.3k steps: one drafted token pays only above 30% acceptance
    dl = _fixed(max_k=8, prior_acceptance=0.9, cost_per_token=0.3)
    assert 4 <= dl.choose(3, 8) <= 6 and dl.choose(3, 3) == 3 and dl.choose(3, 0) == 0
    for _ in range(3):
        dl.update(3, 8, 0)  # rejected at once, three times: 0.9 -> 0.675 -> 0.506 -> 0.380
    assert dl.acceptance[3] == pytest.approx(0.380, abs=1e-3) and dl.choose(3, 8) == 1
    dl.update(3, 8, 0)
    assert dl.acceptance[3] < 0.3 and dl.choose(3, 8) == 0  # nothing pays: a plain step
    assert dl.choose(2, 8) >= 4  # another source keeps its own estimate
    for _ in range(6):  # a burst of copying brings the length back within a few drafts
        dl.update(3, 1, 1)
    assert dl.choose(3, 8) >= 3


def test_expensive_calls_are_not_worth_a_draft_and_are_probed_now_and_then():
    dl = _fixed(max_k=8, prior_acceptance=0.3, cost_per_token=0.8, probe_every=4)
    # E(1) = 1.3 tokens for a call costing 1.8 steps: never worth it, except the periodic probe
    assert [dl.choose(1, 8) for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]


def test_measured_call_times_replace_the_cost_line():
    dl = DraftLength(max_k=4, prior_acceptance=0.6, probe_every=100)
    assert dl.choose(1, 4) > 0  # the prior line: verification is cheap
    dl.timed(1, 0.010)
    for fed in (2, 3, 4, 5):
        dl.timed(fed, 0.040)  # every verification costs four steps
    assert dl.cost(3) == pytest.approx(4.0) and dl.choose(1, 4) == 0
    dl.timed(1, 0.0)  # a zero reading is ignored
    assert dl.step_seconds == 0.010
    for bad in ({"max_k": 0}, {"prior_acceptance": 1.0}, {"rate": 0.0}, {"probe_every": 0}):
        with pytest.raises(ValueError):
            DraftLength(**bad)


def test_declined_lookups_are_checked_for_free_so_copying_is_noticed_without_probes():
    """A source the policy turned off learns from its declined proposals against what the target emitted
    (no paid probe), and a source whose proposals cost nothing to check is never probed."""
    dl = _fixed(max_k=4, prior_acceptance=0.2, cost_per_token=0.3, probe_every=2)
    assert [dl.choose(3, 4, probe=False) for _ in range(4)] == [0, 0, 0, 0]  # no probe, however long
    dl.observe(3, [7, 8, 9, 10], [7, 8, 9, 10, 11])  # the target copied all four: four held
    assert dl.acceptance[3] > 0.5 and dl.choose(3, 4, probe=False) >= 2
    dl.observe(3, [7, 8, 9], [7, 5])  # held once, then a rejection
    a = dl.acceptance[3]
    dl.observe(3, [7, 8, 9], [7])  # one held; nothing seen past what was emitted
    assert dl.acceptance[3] > a


def test_failed_probes_come_ever_more_rarely_and_one_that_holds_resets_them():
    dl = _fixed(max_k=4, prior_acceptance=0.05, cost_per_token=0.8, probe_every=4)

    def gap() -> int:  # declined proposals until the next probe, whose verdict is then reported
        n = 1
        while dl.choose("model", 4) == 0:
            n += 1
        return n

    gaps = []
    for _ in range(3):
        gaps.append(gap())
        dl.update("model", 1, 0)  # the probe failed
    assert gaps == [4, 8, 16]
    gap()
    dl.update("model", 1, 1)  # this one held: back to the short gap
    assert gap() == 4


def test_one_slow_call_does_not_price_a_length():
    """Call times are the median of the last calls: one call slowed by the OS does not turn drafts off."""
    dl = DraftLength()
    for _ in range(7):
        dl.timed(1, 0.010)
        dl.timed(5, 0.015)
    dl.timed(5, 0.200)
    assert dl.cost(5) == pytest.approx(1.5)


def test_a_draft_model_is_priced_by_its_calls():
    dl = _fixed(max_k=6, prior_acceptance=0.7, cost_per_token=0.1)
    cheap, dear = dl.choose("model", 6, per_token=0.05), dl.choose("model", 6, per_token=0.6)
    assert cheap > dear >= 0 and dl.choose("model", 6, per_token=5.0) == 0
    timed = DraftLength(prior_acceptance=0.7)
    assert timed.draft_cost() == timed.draft_cost_prior
    timed.timed(1, 0.010)
    timed.timed_draft(0.002)
    assert timed.draft_cost() == pytest.approx(0.2)
