"""Prompt lookup proposes what followed the latest earlier occurrence of the context's last n-gram,
from an index kept up to date as tokens arrive (the draft model's tests run through the loop, in
test_speculative.py)."""

from __future__ import annotations

import random

import pytest

from export.decoding.drafters import NgramDrafter


def _brute_force(ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The reference prompt lookup: scan back for the latest earlier occurrence of the last n-gram."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        tail = ids[len(ids) - n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == tail:
                return ids[start + n : start + n + k]
    return []


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    d = NgramDrafter(max_ngram=2)
    ctx = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    d.extend(ctx)
    assert d.propose(ctx, 3) == [9, 2, 5]  # "5 6" last seen before the end at index 5
    assert d.propose(ctx, 0) == []
    assert NgramDrafter().propose([1, 2, 3], 4) == []  # nothing repeats


@pytest.mark.parametrize("seed", range(20))
def test_the_incremental_index_matches_a_scan_of_the_context(seed):
    rng = random.Random(seed)
    d, ctx = NgramDrafter(max_ngram=3, min_ngram=1), []
    for _ in range(200):
        piece = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        ctx += piece
        d.extend(piece)
        k = rng.randint(1, 6)
        assert d.propose(ctx, k) == _brute_force(ctx, k, 3, 1), ctx[-8:]


def test_a_drafter_not_kept_up_to_date_rebuilds_itself():
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 1, 2], 2) == [3, 1]
