"""Speculative greedy decoding: several tokens per read of the weights, the same tokens as plain greedy.

Decoding on a phone is bound by memory bandwidth: every step reads all the weights for one token.
A drafter proposes ``k`` tokens, the target scores the last emitted token and the ``k`` drafts in
one call (``k + 1`` positions for about the weights' read of one), and the longest prefix of the
drafts that equals the target's own greedy choice at each position is kept, plus the target's
choice after it. Rejected positions are cut from the KV cache (:meth:`Runner.truncate`). Every
kept token is the target's argmax given the tokens before it, so where a position's logits do not
depend on how many tokens a call feeds (eager fp32; tested), the output is plain greedy decoding's
(:func:`export.runtime.greedy_generate`), token for token, with the same stops: an EOS id,
``max_new_tokens``, and a full cache. A runtime's ordinary several-token call need not give that:
ExecuTorch's attention kernel sums a block of query rows in another order than one row, and in a
program with dynamically quantized activations the difference flips roundings (SmolLM2 8da4w: a few
percent of the logit scale, and greedy output that diverges within tens of tokens). So the loop runs
on :meth:`Runner.speculative_runner`, whose verification calls give one-token calls' logits bit for
bit (a ``.pte``'s ``verify`` method, exported with ``verify_tokens``: attention row by row).

Drafters here: :class:`NgramDrafter` (prompt lookup: what followed the latest earlier occurrence of
the context's last n-gram; no model, strong where the answer copies its input).

The draft length adapts (:class:`DraftLength`): each proposal is cut to the length that earns the
most tokens per second, from the acceptance its source has had and the measured time of the
runner's calls by length; where no length pays, steps are plain (one token through the ordinary
forward), with a short probe now and then, so a prompt where drafts fail costs plain decoding's
steps plus a dictionary lookup per token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Protocol

import torch

from export.runtime import Runner, RunnerError, checked_prompt


class Drafter(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``context`` (may be empty)."""

    def extend(self, tokens: list[int]) -> None:
        """``tokens`` were appended to the context (the drafter's index follows them)."""


class NgramDrafter:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the context's
    last ``n`` tokens, for the longest ``n`` from ``max_ngram`` down to ``min_ngram`` that occurs.

    An index from each n-gram to the position after its latest occurrence is kept up to date as
    tokens arrive, so a proposal is ``max_ngram`` dictionary lookups, not a scan of the context."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        #: the n-gram length the last proposal matched (0: none), the source DraftLength estimates by
        self.last_source = 0
        self._ids: list[int] = []
        #: n-gram -> position just after its latest occurrence that is not the context's end
        self._latest: dict[tuple[int, ...], int] = {}
        #: per n: the occurrence that ends at the context's end, indexed once the context grows past it
        self._pending: dict[int, tuple[tuple[int, ...], int]] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            # the n-grams that ended at the old end now have a successor: make them findable
            for key, end in self._pending.values():
                self._latest[key] = end
            self._ids.append(int(t))
            end = len(self._ids)
            self._pending = {n: (tuple(self._ids[end - n:]), end)
                             for n in range(self.min_ngram, self.max_ngram + 1) if end >= n}

    def propose(self, context: list[int], k: int) -> list[int]:
        if len(context) != len(self._ids):  # a caller that did not keep us up to date: rebuild
            self.__init__(self.max_ngram, self.min_ngram)
            self.extend(context)
        self.last_source = 0
        if k <= 0:
            return []
        ids = self._ids
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(ids[len(ids) - n:]))
            if start is not None:
                self.last_source = n
                return ids[start : start + k]
        return []


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
    a one-token draft every ``probe_every`` proposals keeps the estimate fresh: drafts that keep
    failing cost one short call in ``probe_every`` steps, so decoding stays within a few percent of
    plain (the bench's 0.95x floor)."""

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

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 0.0 < self.prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance must be in (0, 1), got {self.prior_acceptance}")
        if not 0.0 < self.rate <= 1.0 or self.probe_every < 1 or self.min_gain <= 0:
            raise ValueError(f"need 0 < rate <= 1, probe_every >= 1 and min_gain > 0, got {self.rate}, "
                             f"{self.probe_every}, {self.min_gain}")
        self.acceptance: dict = {}
        #: fed tokens -> exponential average of one call's seconds
        self.seconds: dict[int, float] = {}
        self._idle = 0

    def cost(self, fed: int) -> float:
        """A call of ``fed`` tokens over a one-token step: measured where both are, else the prior line."""
        one = self.seconds.get(1)
        if self.measure and one and fed in self.seconds:
            return self.seconds[fed] / one
        return 1.0 + self.cost_per_token * (fed - 1)

    def choose(self, source, available: int) -> int:
        """How many of ``available`` proposed tokens (from ``source``) to verify; 0: a plain step."""
        if available <= 0:
            return 0
        a = self.acceptance.get(source, self.prior_acceptance)
        best_k, best = 0, self.min_gain
        for k in range(1, min(self.max_k, available) + 1):
            kept = (1.0 - a ** (k + 1)) / (1.0 - a) if a < 1.0 else k + 1.0
            gain = kept / self.cost(k + 1)
            if gain > best:
                best_k, best = k, gain
        if best_k:
            self._idle = 0
            return best_k
        self._idle += 1
        if self._idle >= self.probe_every:
            self._idle = 0
            return 1
        return 0

    def update(self, source, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` tokens held: each kept token and the first rejected one are
        observations of ``source``'s acceptance."""
        if drafted <= 0:
            return
        a = self.acceptance.get(source, self.prior_acceptance)
        for held in [1.0] * accepted + ([0.0] if accepted < drafted else []):
            a += self.rate * (held - a)
        self.acceptance[source] = min(max(a, 1e-3), 1.0 - 1e-3)

    def timed(self, fed: int, seconds: float) -> None:
        """One call of ``fed`` tokens took ``seconds`` (the first of each length sets its average)."""
        if not self.measure or seconds <= 0:
            return
        old = self.seconds.get(fed)
        self.seconds[fed] = seconds if old is None else old + 0.2 * (seconds - old)


@dataclass
class SpeculativeStats:
    """What the drafts did: forward calls after the prefill, those that verified drafts, tokens
    drafted and accepted."""

    tokens: int = 0
    calls: int = 0
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_call(self) -> float:
        """Generated tokens per forward call after the prefill (plain greedy: 1.0)."""
        return self.tokens / self.calls if self.calls else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_call"] = round(self.tokens_per_call, 3)
        d["acceptance"] = round(self.accepted / self.drafted, 3) if self.drafted else None
        return d


def speculative_generate(
    runner: Runner,
    prompt_ids: Iterable[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    drafter: Drafter | None = None,
    draft: DraftLength | None = None,
    eos_token_ids: Iterable[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> tuple[list[int], SpeculativeStats]:
    """Greedy decoding of ``max_new_tokens`` after ``prompt_ids`` with drafts verified in one call
    each; returns the new ids (exactly :func:`~export.runtime.greedy_generate`'s) and the stats.

    The runner must return every fed position's logits (``forward(..., all_logits=True)``) and cut
    its cache back exactly (``truncate``); a runner that cannot is refused with the reason. Without a
    ``draft`` policy the runner's own (``runner.draft_policy``) is used and kept, so what one
    generation measured of the call times and acceptance serves the next."""
    ids = checked_prompt(runner, prompt_ids, "speculative_generate").tolist()
    limit = runner.max_seq_len
    widest = runner.verify_tokens  # the most tokens one verification call takes (None: unbounded)
    drafter = drafter if drafter is not None else NgramDrafter()
    if draft is None:  # the runner's own policy, kept across generations: its call times are the program's
        draft = runner.draft_policy = runner.draft_policy or DraftLength()
    eos = {int(e) for e in eos_token_ids}
    stats = SpeculativeStats()
    out: list[int] = []
    context = list(ids)
    drafter.extend(context)

    def emit(t: int) -> bool:
        """Append one generated token; False when plain greedy would stop after it."""
        out.append(t)
        context.append(t)
        drafter.extend([t])
        if on_token is not None:
            on_token(t)
        fed = len(ids) + len(out) - 1  # plain greedy has fed every emitted token but the last
        return t not in eos and len(out) < max_new_tokens and (limit is None or fed < limit)

    if max_new_tokens <= 0:
        return out, stats
    runner.reset()
    logits = runner.forward(torch.tensor(ids, dtype=torch.long), all_logits=False)
    nxt = int(torch.argmax(logits[-1]).item())
    while emit(nxt):
        fed = runner.position
        room = max_new_tokens - len(out)  # drafts beyond the last token wanted are never kept
        if limit is not None:
            room = min(room, limit - fed - 1)
        if widest is not None:
            room = min(room, widest - 1)
        proposal = drafter.propose(context, min(draft.max_k, room)) if room > 0 else []
        source = getattr(drafter, "last_source", None)
        proposal = proposal[: draft.choose(source, len(proposal))]
        feed = torch.tensor([nxt, *proposal], dtype=torch.long)
        t0 = time.perf_counter()
        logits = runner.forward(feed, all_logits=True)
        if logits.shape[0] != feed.numel():
            raise RunnerError(f"{runner.runtime} returned {logits.shape[0]} positions' logits for {feed.numel()} "
                              "tokens; speculative decoding needs every position's (an ExecuTorch program "
                              "exported with verify_tokens, through its speculative_runner())")
        choice = torch.argmax(logits, dim=-1).tolist()
        draft.timed(int(feed.numel()), time.perf_counter() - t0)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == choice[accepted]:
            accepted += 1
        stats.calls += 1
        if proposal:
            stats.verify_calls += 1
            stats.drafted += len(proposal)
            stats.accepted += accepted
        draft.update(source, len(proposal), accepted)
        if accepted < len(proposal) and not runner.truncate(fed + 1 + accepted):
            raise RunnerError(f"{runner.runtime} cannot cut its KV cache back exactly (a ring cache?): "
                              "speculative decoding needs it; decode plainly")
        if not all(emit(t) for t in proposal[:accepted]):  # all() stops at the first token that ends it
            break
        nxt = int(choice[accepted])
    stats.tokens = len(out)
    return out, stats
