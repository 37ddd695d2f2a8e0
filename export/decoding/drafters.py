"""What a speculative decoding loop verifies: the drafters (:mod:`export.decoding.speculative` runs the loop).

:class:`NgramDrafter` (prompt lookup: what followed the latest earlier occurrence of the context's
last n-gram; no model, strong where the answer copies its input), :class:`ModelDrafter` (a small
draft model's own greedy tokens, through a runner of its own: a ``.pte``'s ``draft`` method, made by
the pipeline's ``draft`` block), and :class:`HybridDrafter` (prompt lookup where it matches, the
draft model elsewhere). Each asks the loop's :class:`~export.decoding.draft_policy.DraftLength` how many
tokens are worth verifying.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Protocol

import numpy as np
import torch

from export.decoding.runtime import Runner, argmax_ids

if TYPE_CHECKING:
    from export.decoding.draft_policy import DraftLength


class Drafter(Protocol):
    def draft(self, context: list[int], room: int, policy: "DraftLength") -> tuple[list[int], object]:
        """The tokens to verify after ``context`` (at most ``room``; may be empty: a plain step) and
        their source, the key ``policy`` keeps acceptance by. The drafter asks ``policy`` how many are
        worth verifying: a lookup proposes first and cuts, a model asks before it spends a call a token."""

    def extend(self, tokens: list[int]) -> None:
        """``tokens`` were appended to the context (the drafter's index follows them)."""

    #: the last draft() call's proposal that ``policy`` turned down, with its source (None: none). It
    #: cost nothing to make (prompt lookup), so the loop checks it against what the target emits and
    #: the policy learns that source's acceptance without paying for a verification
    declined: tuple[list[int], object] | None


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
        #: the last proposal the policy declined, and its source (the Drafter protocol's)
        self.declined: tuple[list[int], object] | None = None
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

    def draft(self, context: list[int], room: int, policy: "DraftLength") -> tuple[list[int], object]:
        """Prompt lookup's proposal, cut to the length ``policy`` finds worth a verification call. A
        proposal it declines is kept in :attr:`declined`: checking it against the target's next
        tokens is free, so the policy needs no paid probes to notice that a source came back."""
        proposal = self.propose(context, min(policy.max_k, room)) if room > 0 else []
        source = self.last_source
        k = policy.choose(source, len(proposal), probe=False)
        self.declined = (proposal, source) if proposal and not k else None
        return proposal[:k], source


#: DraftLength's key for a draft model's proposals (prompt lookup's are its n-gram lengths)
MODEL_SOURCE = "model"


class ModelDrafter:
    """A draft model's greedy tokens: ``runner`` (a :class:`~export.decoding.runtime.Runner` over the draft: a
    ``.pte``'s ``draft`` method, or any causal LM sharing the target's tokenizer) decodes up to ``k``
    tokens after the context, one call each, stopping early where its own top probability falls below
    ``stop_below`` (an unsure draft token is likely rejected, and each one costs a call).

    The draft keeps its own KV cache: what it has fed is kept in step with the context by their common
    prefix, so after a verification the rejected positions are cut (``truncate``) and what the target
    emitted is fed with the next call (one or two tokens; more after rounds that prompt lookup served).
    ``vocab_ids`` maps a draft whose head covers part of the vocabulary (index -> token id)."""

    def __init__(self, runner: Runner, *, stop_below: float = 0.0, vocab_ids: list[int] | None = None):
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(f"stop_below must be in [0, 1), got {stop_below}")
        self.runner, self.stop_below = runner, stop_below
        self.vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long) if vocab_ids is not None else None
        #: the tokens in the draft's cache, in order
        self.fed: list[int] = []
        #: draft calls and tokens they fed, for the stats
        self.calls = 0
        #: a declined model draft was never made (it costs calls): nothing to check for free
        self.declined = None

    def extend(self, tokens: Iterable[int]) -> None:  # the context is read at each draft() instead
        return None

    def _sync(self, context: list[int]) -> list[int]:
        """Cut the draft's cache to its common prefix with ``context``; the tokens still to feed (never
        none: the last context token's logits give the first draft)."""
        fed, n = self.fed, min(len(self.fed), len(context) - 1)
        if self.runner.position != len(fed):  # the runner served someone else meanwhile: start over
            self.runner.reset()
            fed.clear()
        common = n if fed[:n] == context[:n] else 0  # the usual case in one comparison: the context only grew
        while common < n and fed[common] == context[common]:
            common += 1
        if common < len(fed):
            if common == 0 or not self.runner.truncate(common):
                self.runner.reset()
                common = 0
            del fed[common:]
        return context[common:]

    def _step(self, ids: list[int]) -> tuple[int, float]:
        """Feed ``ids``; the draft's greedy next token and its probability."""
        logits = self.runner.forward(torch.tensor(ids, dtype=torch.long), all_logits=False)[-1]
        self.fed.extend(ids)
        self.calls += 1
        best = argmax_ids(logits)[0]
        p = 1.0
        if self.stop_below > 0:  # softmax's top probability, in numpy for argmax_ids' reason
            row = logits.detach().to("cpu", torch.float32).numpy()
            p = float(1.0 / np.exp(row - row[best]).sum())
        return (int(self.vocab_ids[best]) if self.vocab_ids is not None else best), p

    def propose(self, context: list[int], k: int, policy: "DraftLength | None" = None) -> list[int]:
        """Up to ``k`` draft tokens after ``context`` (the first call feeds whatever the draft lacks)."""
        if k <= 0:
            return []
        limit = self.runner.max_seq_len
        if limit is not None:  # the draft's cache holds the context and all but the last draft token
            k = min(k, limit - len(context) + 1)
            if k <= 0:
                return []
        out: list[int] = []
        t0 = time.perf_counter()
        feed = self._sync(context)
        while len(out) < k:
            token, p = self._step(feed)
            if out and p < self.stop_below:
                break
            out.append(token)
            feed = [token]
        if policy is not None:
            # what a drafted token cost, the catch-up included: after rounds that lookup served (or plain
            # steps), the first call feeds every token the draft missed, and that is paid for the draft
            policy.timed_draft((time.perf_counter() - t0) / len(out))
        return out

    def draft(self, context: list[int], room: int, policy: "DraftLength") -> tuple[list[int], object]:
        """As many draft tokens as ``policy`` finds worth their calls and a verification."""
        k = policy.choose(MODEL_SOURCE, room, per_token=policy.draft_cost())
        return self.propose(context, k, policy), MODEL_SOURCE


class HybridDrafter:
    """Prompt lookup where it has a proposal worth verifying (free: no model call), else the draft model:
    copying spans costs nothing to draft, and open text gets the model's guesses."""

    def __init__(self, model: ModelDrafter, lookup: NgramDrafter | None = None):
        self.model, self.lookup = model, lookup if lookup is not None else NgramDrafter()

    def extend(self, tokens: Iterable[int]) -> None:
        self.lookup.extend(tokens)

    @property
    def declined(self) -> tuple[list[int], object] | None:
        return self.lookup.declined

    def draft(self, context: list[int], room: int, policy: "DraftLength") -> tuple[list[int], object]:
        proposal, source = self.lookup.draft(context, room, policy)
        if proposal:
            return proposal, source
        return self.model.draft(context, room, policy)
