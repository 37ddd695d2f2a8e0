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
the context's last n-gram; no model, strong where the answer copies its input), :class:`ModelDrafter`
(a small draft model's own greedy tokens, through a runner of its own: a ``.pte``'s ``draft`` method,
made by the pipeline's ``draft`` block), and :class:`HybridDrafter` (prompt lookup where it matches,
the draft model elsewhere).

The draft length adapts (:class:`DraftLength`): each proposal is cut to the length that earns the
most tokens per second, from the acceptance its source has had and the measured time of the
runner's calls by length; where no length pays, steps are plain (one token through the ordinary
forward), so a prompt where drafts fail costs plain decoding's steps plus a dictionary lookup per
token. A lookup proposal the policy declines is still checked against the tokens the target emits
(free), so the policy notices when copying resumes; a draft model's source, whose proposals cost
calls, gets a short paid probe now and then instead.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Protocol

import numpy as np
import torch

from export.runtime import Runner, RunnerError, argmax_ids, checked_prompt


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


#: calls of each length whose median prices the next (DraftLength.timed)
TIMED_CALLS = 15

#: a paid probe's gap grows to at most this many times DraftLength.probe_every after failed probes
PROBE_BACKOFF = 16

#: DraftLength's key for a draft model's proposals (prompt lookup's are its n-gram lengths)
MODEL_SOURCE = "model"


class ModelDrafter:
    """A draft model's greedy tokens: ``runner`` (a :class:`~export.runtime.Runner` over the draft: a
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
        #: fed tokens -> one call's seconds: the median of its last TIMED_CALLS calls (one call's time jitters
        #: by tens of percent, and a mean led by one slow call once priced 4-token verifications at 4 steps)
        self.seconds: dict[int, float] = {}
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
        one = self.seconds.get(1)
        if self.measure and seconds > 0 and one:
            self.draft_relative = self._median("draft", seconds / one)

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
        one = self.seconds.get(1)
        self.seconds[fed] = self._median(fed, seconds)
        if fed > 1 and one:
            self.relative[fed] = self._median(("relative", fed), seconds / one)


@dataclass
class SpeculativeStats:
    """What the drafts did: forward calls after the prefill, those that verified drafts, tokens
    drafted and accepted, and the draft model's calls (its prefill included)."""

    tokens: int = 0
    calls: int = 0
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_calls: int = 0

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
    draft_calls0 = _draft_calls(drafter)

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
    need = len(ids) + max_new_tokens + (widest or 0)
    runner.reserve(min(need, limit) if limit is not None else need)
    runner.reset()
    logits = runner.forward(torch.tensor(ids, dtype=torch.long), all_logits=False)
    nxt = argmax_ids(logits[-1])[0]
    while emit(nxt):
        fed = runner.position
        room = max_new_tokens - len(out)  # drafts beyond the last token wanted are never kept
        if limit is not None:
            room = min(room, limit - fed - 1)
        if widest is not None:
            room = min(room, widest - 1)
        proposal, source = drafter.draft(context, room, draft) if room > 0 else ([], None)
        declined = getattr(drafter, "declined", None) if room > 0 else None
        feed = torch.tensor([nxt, *proposal], dtype=torch.long)
        t0 = time.perf_counter()
        # a step without a draft is plain greedy's own call (the last position's logits), so it costs what a
        # plain step costs and runs the same graph path; only a verification call asks for every position
        logits = runner.forward(feed, all_logits=bool(proposal))
        if logits.shape[0] != feed.numel():
            raise RunnerError(f"{runner.runtime} returned {logits.shape[0]} positions' logits for {feed.numel()} "
                              "tokens; speculative decoding needs every position's (an ExecuTorch program "
                              "exported with verify_tokens, through its speculative_runner())")
        choice = argmax_ids(logits)  # not torch.argmax: its woken thread pool slows the next call (argmax_ids)
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
        if declined is not None:  # a lookup the policy turned down, checked against what the target chose
            draft.observe(declined[1], declined[0], [*proposal[:accepted], int(choice[accepted])])
        if accepted < len(proposal) and not runner.truncate(fed + 1 + accepted):
            raise RunnerError(f"{runner.runtime} cannot cut its KV cache back exactly (a ring cache?): "
                              "speculative decoding needs it; decode plainly")
        if not all(emit(t) for t in proposal[:accepted]):  # all() stops at the first token that ends it
            break
        nxt = int(choice[accepted])
    stats.tokens = len(out)
    stats.draft_calls = _draft_calls(drafter) - draft_calls0
    return out, stats


def _draft_calls(drafter) -> int:
    model = drafter if isinstance(drafter, ModelDrafter) else getattr(drafter, "model", None)
    return model.calls if isinstance(model, ModelDrafter) else 0
