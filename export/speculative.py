"""Speculative greedy decoding: several tokens per read of the weights, the same tokens as plain greedy.

Decoding on a phone is bound by memory bandwidth: every step reads all the weights for one token.
A drafter proposes ``k`` tokens, the target scores the last emitted token and the ``k`` drafts in
one call (``k + 1`` positions for about the weights' read of one), and the longest prefix of the
drafts that equals the target's own greedy choice at each position is kept, plus the target's
choice after it. Rejected positions are cut from the KV cache (:meth:`Runner.truncate`). Every
kept token is the target's argmax given the tokens before it, so where a position's logits do not
depend on how many tokens a call feeds (eager fp32; tested), the output is plain greedy decoding's
(:func:`export.runtime.greedy_generate`), token for token, with the same stops: an EOS id,
``max_new_tokens``, and a full cache. The demo ``.pte``'s chunked calls do not give its one-token
calls' logits (docs/executorch.md), so its verified tokens can differ from its plain ones.

Drafters here: :class:`NgramDrafter` (prompt lookup: what followed the latest earlier occurrence of
the context's last n-gram; no model, strong where the answer copies its input).

The draft length adapts (:class:`DraftLength`): it grows while drafts are accepted whole and
shrinks when they fail, and after repeated misses drafting pauses for a number of steps that
doubles each time, so a prompt where lookup finds nothing costs plain decoding's steps plus a
dictionary lookup per token.
"""

from __future__ import annotations

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
        if k <= 0:
            return []
        ids = self._ids
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(ids[len(ids) - n:]))
            if start is not None:
                return ids[start : start + k]
        return []


@dataclass
class DraftLength:
    """How many tokens to draft next: grows on a draft accepted whole, halves on one rejected at its
    first token; after ``patience`` misses in a row, drafting pauses for ``pause`` steps, a pause
    that doubles each time it recurs (up to ``max_pause``) and resets when a draft is accepted."""

    k: int = 4
    min_k: int = 1
    max_k: int = 8
    patience: int = 3
    max_pause: int = 64
    misses: int = 0
    pause: int = 0
    next_pause: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_k <= self.k <= self.max_k:
            raise ValueError(f"need 1 <= min_k <= k <= max_k, got {self.min_k}, {self.k}, {self.max_k}")

    def wanted(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == 0:
            self.misses += 1
            self.k = max(self.min_k, self.k // 2)
            if self.misses >= self.patience:
                self.pause, self.misses = self.next_pause, 0
                self.next_pause = min(self.max_pause, self.next_pause * 2)
            return
        self.misses, self.next_pause = 0, 4
        if accepted == drafted:
            self.k = min(self.max_k, self.k + 2)


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
    its cache back exactly (``truncate``); a runner that cannot is refused with the reason."""
    ids = checked_prompt(runner, prompt_ids, "speculative_generate").tolist()
    limit = runner.max_seq_len
    drafter = drafter if drafter is not None else NgramDrafter()
    draft = draft if draft is not None else DraftLength()
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
        proposal = drafter.propose(context, min(draft.wanted(), room)) if room > 0 else []
        feed = torch.tensor([nxt, *proposal], dtype=torch.long)
        logits = runner.forward(feed, all_logits=True)
        if logits.shape[0] != feed.numel():
            raise RunnerError(f"{runner.runtime} returned {logits.shape[0]} positions' logits for {feed.numel()} "
                              "tokens; speculative decoding needs every position's (an ExecuTorch program "
                              "exported with scoring_method: true, through its scoring_runner())")
        choice = torch.argmax(logits, dim=-1).tolist()
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == choice[accepted]:
            accepted += 1
        stats.calls += 1
        if proposal:
            stats.verify_calls += 1
            stats.drafted += len(proposal)
            stats.accepted += accepted
        draft.update(len(proposal), accepted)
        if accepted < len(proposal) and not runner.truncate(fed + 1 + accepted):
            raise RunnerError(f"{runner.runtime} cannot cut its KV cache back exactly (a ring cache?): "
                              "speculative decoding needs it; decode plainly")
        if not all(emit(t) for t in proposal[:accepted]):  # all() stops at the first token that ends it
            break
        nxt = int(choice[accepted])
    stats.tokens = len(out)
    return out, stats
