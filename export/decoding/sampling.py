"""Sampled decoding that speculative decoding reproduces token for token: one uniform number per
emitted token, turned into a token by the inverse CDF of the target's distribution at that position.

Why this shape: the standard rule for verifying a draft token ``x`` proposed with probability
``q(x)`` accepts it with probability ``min(1, p(x) / q(x))`` and, on rejection, samples from
``max(p - q, 0)`` renormalized; the emitted tokens are then distributed exactly as the target's own
samples (Leviathan et al. 2023, Chen et al. 2023). The project's drafters are deterministic given
the context (prompt lookup, a draft model's greedy tokens), so ``q`` is a point mass on ``x``: the
rule accepts ``x`` with probability ``p(x)`` and otherwise samples ``p`` with ``x`` removed. Drawing
the target's token ``y = F^-1(u)`` from a fresh uniform ``u`` and accepting the draft when ``y == x``
is that rule: ``P(y = x) = p(x)``, and given ``y != x``, ``y`` follows ``p`` without ``x``,
renormalized. Taking one ``u`` per emitted token from one seeded stream makes it more than equal in
distribution: speculative decoding emits exactly the tokens plain sampling emits with the same seed
(the draft decides only how many positions one call scores), so a seed reproduces an answer whether
or not drafts were used, and the tests compare tokens, not only histograms.

Warping follows transformers' ``generate`` (temperature, then top-k, then top-p, at least one token
kept), with weights in float32 as it computes them and sums in float64. Where a position's logits are the same bits in both loops, so is its token: the
order the inverse CDF walks is fixed (descending probability, ties by token id, when top-k or top-p
cuts; vocabulary order otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: top-k and top-p first look only at tokens weighing at least this much against the most likely one
#: (exp((x - max) / T)), and lower it where those do not hold the answer
CANDIDATE_WEIGHT = 1e-3
#: the inverse CDF sums a long row by blocks of this many tokens first
BLOCK = 256


@dataclass(frozen=True)
class Sampling:
    """How to sample: ``temperature`` (> 0; greedy decoding is no ``Sampling`` at all), ``top_k`` (keep
    the k most likely tokens, and any tied with the k-th), ``top_p`` (keep the fewest most likely tokens
    whose mass reaches p), ``seed`` (None: a fresh one from the operating system; the same seed gives
    the same tokens)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a number > 0 (0 means greedy decoding: sample nothing), got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (or unset), got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (or unset), got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ValueError(f"seed must be an integer >= 0 (or unset), got {s!r}")

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """The warped distribution of one row of logits: ``(ids, probs)`` with ``probs`` (float64, summing
        to 1) in the order the inverse CDF walks, ``ids`` the token of each (None: the whole vocabulary
        in order)."""
        ids, weights = self.weights(logits)
        probs = weights.astype(np.float64)
        return ids, probs / probs.sum()

    def weights(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """:meth:`distribution` unnormalized: float32 weights ``exp((x - max) / T)`` (1 for the most
        likely token), in float32 as transformers computes them from float32 logits.

        Fast on a 49k vocabulary (a sampled token should not cost a tenth of a decode step): top-k
        and top-p look only at the tokens with a weight of at least ``CANDIDATE_WEIGHT`` (a partial
        sort of the whole row costs 0.4-0.6 ms), widening the threshold until those hold the answer.
        On SmolLM2's logits (61 positions of a chat answer, this host) a token costs 0.08-0.13 ms with
        or without top-k/top-p at temperatures 0.7-1.0 (argmax: 0.005); a flat row costs more where
        top-p keeps thousands of tokens (temperature 1.5, top-p 0.95: 0.4 ms median, 1.3 ms p90)."""
        x = np.asarray(logits, dtype=np.float32).reshape(-1) / np.float32(self.temperature)
        top = x.max()
        if not np.isfinite(top):
            raise ValueError("the logits have no finite maximum (NaN or inf): nothing to sample from")
        w = np.exp(x - top)
        ids = None
        if self.top_k is not None and self.top_k < x.size:
            ids = _largest(x, w, self.top_k)
            w = w[ids]
        if self.top_p is not None and self.top_p < 1:
            ids, w = _nucleus(ids, x, w, self.top_p)
        return ids, w


class TokenSampler:
    """Draws the target's token at each emitted position: one uniform number a token, in order,
    from one seeded stream (``numpy.random.default_rng(seed)``), so plain and speculative decoding
    with the same seed emit the same tokens."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self._rng = np.random.default_rng(sampling.seed)

    def choose(self, logits) -> int:
        """The token for the next emitted position, from its row of logits (consumes one draw)."""
        ids, w = self.sampling.weights(_row(logits))
        at = _inverse_cdf(w, self._rng.random())
        return int(at if ids is None else ids[at])

    def walk(self, logits, proposal: list[int]) -> list[int]:
        """The target's tokens for the rows of one verification call, up to and including the first
        that differs from the draft (or the row after the last drafted token): a draw per emitted token."""
        rows = _rows(logits)
        chosen: list[int] = []
        for i in range(min(len(proposal) + 1, rows.shape[0])):
            chosen.append(self.choose(rows[i]))
            if i == len(proposal) or chosen[-1] != proposal[i]:
                break
        return chosen


def _rows(logits) -> np.ndarray:
    if hasattr(logits, "detach"):  # a torch tensor, read without torch's thread pool (runtime.argmax_ids)
        logits = logits.detach().to("cpu").float().numpy()
    rows = np.asarray(logits)
    return rows.reshape(-1, rows.shape[-1])


def _row(logits) -> np.ndarray:
    rows = _rows(logits)
    if rows.shape[0] != 1:
        raise ValueError(f"one row of logits expected, got {rows.shape[0]}")
    return rows[0]


def _inverse_cdf(w: np.ndarray, u: float) -> int:
    """The first index where the running sum of ``w`` (float64) exceeds ``u`` times its total; never a
    zero weight. Over a long row the sum runs by blocks of ``BLOCK`` and then inside one block (a
    sequential cumulative sum of 49k numbers costs 0.16 ms; this, about 0.03)."""
    n = w.size
    if n <= 4 * BLOCK:
        c = np.cumsum(w, dtype=np.float64)
        at = int(np.searchsorted(c, u * c[-1], side="right"))
        return at if at < n else int(np.flatnonzero(w)[-1])
    padded = np.zeros(-(-n // BLOCK) * BLOCK, dtype=w.dtype)
    padded[:n] = w
    cb = np.cumsum(padded.reshape(-1, BLOCK).sum(axis=1, dtype=np.float64))
    target = u * cb[-1]
    b = int(np.searchsorted(cb, target, side="right"))
    if b >= cb.size:  # u * total rounded up to the total: the last token with weight
        return int(np.flatnonzero(w)[-1])
    block = padded[b * BLOCK:(b + 1) * BLOCK]
    c = np.cumsum(block, dtype=np.float64)
    i = int(np.searchsorted(c, target - (cb[b - 1] if b else 0.0), side="right"))
    if i >= BLOCK or block[i] == 0:  # rounding between the block's sum and its running sum
        i = int(np.flatnonzero(block)[-1])
    return b * BLOCK + i


def _candidates(w: np.ndarray, enough) -> np.ndarray:
    """Token ids with a weight of at least a threshold, lowered (x 1e-3) until ``enough(ids)``; every
    token outside weighs less than every one inside, so a top-k or a nucleus found inside is the row's."""
    threshold = CANDIDATE_WEIGHT
    while True:
        ids = np.flatnonzero(w >= threshold)
        if threshold == 0 or enough(ids):
            return ids
        threshold = threshold * 1e-3 if threshold > 1e-30 else 0.0


def _ranked_prefix(x: np.ndarray, ids: np.ndarray, m: int) -> np.ndarray:
    """The first tokens of ``ids`` ranked by descending logit, ties by id: the ``m`` largest and any tied
    with the m-th (a partial sort first: ranking all of a flat 49k row costs 3 ms, this 0.2)."""
    if ids.size > m:
        xs = x[ids]
        ids = ids[xs >= np.partition(xs, xs.size - m)[xs.size - m]]
    return ids[np.lexsort((ids, -x[ids]))]


def _largest(x: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """transformers' ``TopKLogitsWarper``: the ``k`` largest logits and any tied with the k-th, by
    descending logit, ties by id."""
    return _ranked_prefix(x, _candidates(w, lambda c: c.size >= k), k)


def _nucleus(ids: np.ndarray | None, x: np.ndarray, w: np.ndarray, top_p: float):
    """transformers' ``TopPLogitsWarper``: a token stays where the tokens ranked above it hold less than
    ``top_p`` of the mass (so at least one stays). ``w`` is over ``ids`` (the whole row where None)."""
    total = float(w.sum(dtype=np.float64))
    need = top_p * total
    if ids is None:
        pool = _candidates(w, lambda c: float(w[c].sum(dtype=np.float64)) >= need)
        look = 64
        while True:  # rank a growing prefix until it holds the nucleus
            order = _ranked_prefix(x, pool, look)
            ranked = w[order]
            if order.size == pool.size or float(ranked.sum(dtype=np.float64)) >= need:
                break
            look *= 8
    else:  # already ranked (top-k)
        order, ranked = np.arange(ids.size), w
    cum = np.cumsum(ranked, dtype=np.float64)
    keep = min(int(np.searchsorted(cum, need, side="left")) + 1, order.size)
    order = order[:keep]
    return (order if ids is None else ids[order]), ranked[:keep]
