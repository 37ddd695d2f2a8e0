"""How many drafted tokens a speculative decoding step verifies (:class:`DraftLength`).

A verification call of several tokens costs more than a one-token step, so a draft pays only where
enough of it is kept; the policy estimates both, per source of drafts, from what the loop observed.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


#: calls of each length whose median prices the next (DraftLength.timed)
TIMED_CALLS = 15

#: a paid probe's gap grows to at most this many times DraftLength.probe_every after failed probes
PROBE_BACKOFF = 16


@dataclass
class DraftLength:
    """How many of a proposal's tokens to verify: the length that earns the most tokens per second.

    A verification call of ``k + 1`` tokens costs more than a one-token step (its rows, and the
    verify method's row-by-row attention), and keeps on average ``E(k) = (1 - a^(k+1)) / (1 - a)``
    tokens when each drafted token holds with probability ``a`` given the ones before it. Each
    proposal's length is the ``k`` that maximises ``E(k) / C(k)``, ``C`` the call's time over a
    one-token step's; ``k = 0`` (a plain step) wins where no length beats 1. ``a`` is estimated per
    source of drafts (prompt lookup's n-gram length: a 3-gram match holds more often than a 1-gram)
    as an exponential average of what verification kept; ``C`` from the timed calls themselves
    (``measure``; else ``1 + cost_per_token * k``, for deterministic tests). When no length pays,
    prompt lookup's declined proposals are checked against what the target emits (:meth:`observe`,
    free), and a draft model's source gets a one-token draft after ``probe_every`` declined proposals,
    the gap doubling after each failed probe (up to ``PROBE_BACKOFF`` times): drafts that keep failing
    cost ever fewer short calls, so decoding stays within a few percent of plain (the bench's 0.95x
    floor)."""

    max_k: int = 8
    prior_acceptance: float = 0.5
    #: weight of one observation in the acceptance average (a burst of copying is found in a few steps)
    rate: float = 0.25
    probe_every: int = 16
    #: time the calls (True), or price a call of k + 1 tokens at 1 + cost_per_token * k
    measure: bool = True
    #: the price line until calls are timed (a .pte's verify costs about this much a row; docs/executorch.md)
    cost_per_token: float = 0.3
    #: a draft must promise this many times a plain step's tokens per second: a gain within the noise
    #: of the estimates is a loss on average, since a wrong draft costs its whole call
    min_gain: float = 1.05
    #: a draft model's token in target steps until both are timed (a quarter-depth draft costs about this)
    draft_cost_prior: float = 0.2

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 0.0 < self.prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance must be in (0, 1), got {self.prior_acceptance}")
        if not 0.0 < self.rate <= 1.0 or self.probe_every < 1 or self.min_gain <= 0 or self.draft_cost_prior < 0:
            raise ValueError(f"need 0 < rate <= 1, probe_every >= 1 and min_gain > 0, got {self.rate}, "
                             f"{self.probe_every}, {self.min_gain}")
        self.acceptance: dict = {}
        #: a one-token step's seconds: the median of the last TIMED_CALLS (one call's time jitters by tens of
        #: percent, and a mean led by one slow call once priced 4-token verifications at 4 steps); None
        #: until one is timed. Longer calls are kept only as ratios to it (relative)
        self.step_seconds: float | None = None
        #: fed tokens (> 1) -> one call over the one-token step of its time: the median of the last
        #: TIMED_CALLS such ratios. A ratio, not seconds over seconds: verification calls are rarer than
        #: one-token steps, and seconds kept from an earlier, longer context (attention grows with it)
        #: priced them at up to 3 steps where they cost 2
        self.relative: dict[int, float] = {}
        #: a draft model's drafted token in one-token steps of the target (the same median of ratios)
        self.draft_relative: float | None = None
        #: proposals between paid probes (doubles after each failed one), and the source probed last
        self._gap = self.probe_every
        self._probed = None
        self._timed: dict[object, deque] = {}
        self._idle = 0

    def cost(self, fed: int) -> float:
        """A call of ``fed`` tokens over a one-token step: measured where both are, else the prior line."""
        if fed == 1:
            return 1.0
        if self.measure and fed in self.relative:
            return self.relative[fed]
        return 1.0 + self.cost_per_token * (fed - 1)

    def choose(self, source, available: int, per_token: float = 0.0, probe: bool = True) -> int:
        """How many of ``available`` proposed tokens (from ``source``) to verify; 0: a plain step.
        ``per_token`` is what drafting one token costs, in one-token steps of the target (a draft
        model's call; 0 for prompt lookup): it is paid for every token drafted, kept or not.
        ``probe=False``: never a paid probe (a source whose declined proposals are checked for free,
        :meth:`observe`)."""
        if available <= 0:
            return 0
        a = self.acceptance.get(source, self.prior_acceptance)
        best_k, best = 0, self.min_gain
        for k in range(1, min(self.max_k, available) + 1):
            kept = (1.0 - a ** (k + 1)) / (1.0 - a) if a < 1.0 else k + 1.0
            gain = kept / (self.cost(k + 1) + k * per_token)
            if gain > best:
                best_k, best = k, gain
        if best_k:
            self._idle = 0
            return best_k
        if not probe:
            return 0
        self._idle += 1
        if self._idle >= self._gap:
            self._idle = 0
            self._probed = source
            return 1
        return 0

    def update(self, source, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` tokens held: each kept token and the first rejected one are
        observations of ``source``'s acceptance."""
        if drafted <= 0:
            return
        if source == self._probed and self._probed is not None:
            # a failed probe doubles the gap to the next (a draft model's probe costs its catch-up calls
            # and a verification: at every 16 proposals that was a tenth of a summary's time); one that
            # held brings it back
            self._probed = None
            self._gap = self.probe_every if accepted else min(2 * self._gap, self.probe_every * PROBE_BACKOFF)
        a = self.acceptance.get(source, self.prior_acceptance)
        for held in [1.0] * accepted + ([0.0] if accepted < drafted else []):
            a += self.rate * (held - a)
        self.acceptance[source] = min(max(a, 1e-3), 1.0 - 1e-3)

    def observe(self, source, proposal: list[int], emitted: list[int]) -> None:
        """A proposal from ``source`` that was not verified, against the tokens the target emitted
        after the same context: its common prefix with them held, and the first difference is a
        rejection (a proposal longer than what was emitted says nothing past it)."""
        held = 0
        while held < len(proposal) and held < len(emitted) and proposal[held] == emitted[held]:
            held += 1
        seen = held + 1 if held < min(len(proposal), len(emitted)) else held
        self.update(source, seen, held)

    def _median(self, key, seconds: float) -> float:
        window = self._timed.setdefault(key, deque(maxlen=TIMED_CALLS))
        window.append(seconds)
        return statistics.median(window)

    def timed_draft(self, seconds: float) -> None:
        """A drafted token took ``seconds`` (its share of the proposal's draft calls, catch-up included)."""
        if self.measure and seconds > 0 and self.step_seconds:
            self.draft_relative = self._median("draft", seconds / self.step_seconds)

    def draft_cost(self) -> float:
        """A draft model's token in one-token steps of the target: measured where both are, else
        ``draft_cost_prior``."""
        if self.measure and self.draft_relative is not None:
            return self.draft_relative
        return self.draft_cost_prior

    def timed(self, fed: int, seconds: float) -> None:
        """One call of ``fed`` tokens took ``seconds`` (a longer call is priced against the one-token
        steps of its time; before the first of those it is not priced)."""
        if not self.measure or seconds <= 0:
            return
        if fed == 1:
            self.step_seconds = self._median(1, seconds)
        elif self.step_seconds:
            self.relative[fed] = self._median(fed, seconds / self.step_seconds)
