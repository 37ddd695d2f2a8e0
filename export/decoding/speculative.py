"""Speculative decoding: several tokens per read of the weights, the same tokens as plain decoding.

Decoding on a phone is bound by memory bandwidth: every step reads all the weights for one token.
A drafter proposes ``k`` tokens, the target scores the last emitted token and the ``k`` drafts in
one call (``k + 1`` positions for about the weights' read of one), and the longest prefix of the
drafts that equals the target's own greedy choice at each position is kept, plus the target's
choice after it. Rejected positions are cut from the KV cache (:meth:`Runner.truncate`). Every
kept token is the target's argmax given the tokens before it, so where a position's logits do not
depend on how many tokens a call feeds (eager fp32; tested), the output is plain greedy decoding's
(:func:`export.decoding.runtime.greedy_generate`), token for token, with the same stops: an EOS id,
``max_new_tokens``, and a full cache. A runtime's ordinary several-token call need not give that:
ExecuTorch's attention kernel sums a block of query rows in another order than one row, and in a
program with dynamically quantized activations the difference flips roundings (SmolLM2 8da4w: a few
percent of the logit scale, and greedy output that diverges within tens of tokens). So the loop runs
on :meth:`Runner.speculative_runner`, whose verification calls give one-token calls' logits bit for
bit (a ``.pte``'s ``verify`` method, exported with ``verify_tokens``: attention row by row).

Drafters (:mod:`export.decoding.drafters`): :class:`NgramDrafter` (prompt lookup: what followed the latest
earlier occurrence of the context's last n-gram; no model, strong where the answer copies its input),
:class:`ModelDrafter` (a small draft model's own greedy tokens, through a runner of its own: a
``.pte``'s ``draft`` method, made by the pipeline's ``draft`` block), and :class:`HybridDrafter`
(prompt lookup where it matches, the draft model elsewhere).

The draft length adapts (:class:`~export.decoding.draft_policy.DraftLength`): each proposal is cut to the
length that earns the most tokens per second, from the acceptance its source has had and the
measured time of the runner's calls by length; where no length pays, steps are plain (one token
through the ordinary forward), so a prompt where drafts fail costs plain decoding's steps plus a
dictionary lookup per token. A lookup proposal the policy declines is still checked against the
tokens the target emits (free), so the policy notices when copying resumes; a draft model's source,
whose proposals cost calls, gets a short paid probe now and then instead.

Sampling (``sampling=``, :mod:`export.decoding.sampling`): the target's token at each position is drawn from
its warped distribution by the inverse CDF of one uniform number per emitted token, and a draft token
is kept when it is that token. For a deterministic draft that is the standard rejection rule (keep
``x`` with probability ``p(x)``, else sample ``p`` without ``x``), so the output follows the target's
distribution; and since the draws are taken in emitted order from one seeded stream, it is also plain
sampling's output with the same seed, token for token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import torch

from export.decoding.draft_policy import PROBE_BACKOFF, TIMED_CALLS, DraftLength
from export.decoding.drafters import MODEL_SOURCE, Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from export.decoding.runtime import Runner, RunnerError, argmax_ids, checked_prompt
from export.decoding.sampling import Sampling, TokenSampler

#: the drafters and the policy are imported from here by the API's users (this module predates the split)
__all__ = ["MODEL_SOURCE", "PROBE_BACKOFF", "TIMED_CALLS", "DraftLength", "Drafter", "HybridDrafter", "ModelDrafter",
           "NgramDrafter", "SpeculativeStats", "speculative_generate"]


@dataclass
class SpeculativeStats:
    """What the drafts did: forward calls after the prefill, those that verified drafts, tokens
    drafted and accepted, the draft model's calls (its prefill included), and what a call of each
    length cost in one-token steps as the policy priced it at the end (measured on this device: the
    figure that says whether verification pays here; empty where calls were not timed)."""

    tokens: int = 0
    calls: int = 0
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_calls: int = 0
    call_cost: dict[int, float] = field(default_factory=dict)

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
    sampling: Sampling | None = None,
) -> tuple[list[int], SpeculativeStats]:
    """Greedy decoding of ``max_new_tokens`` after ``prompt_ids`` with drafts verified in one call
    each; returns the new ids (exactly :func:`~export.decoding.runtime.greedy_generate`'s) and the stats.

    With ``sampling`` the target's token at each position is sampled instead (:mod:`export.decoding.sampling`:
    the standard rejection rule for a deterministic draft, one draw per emitted token), and the new
    ids are exactly :func:`~export.decoding.runtime.generate_ids`' with the same ``sampling`` (its seed included).

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
    sampler = TokenSampler(sampling) if sampling is not None else None
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
    nxt = argmax_ids(logits[-1])[0] if sampler is None else sampler.choose(logits[-1])
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
        # not torch.argmax: its woken thread pool slows the next call (argmax_ids); sampled, the target's tokens
        # up to the first that differs from the draft, a draw each (the rows after it are never emitted)
        choice = argmax_ids(logits) if sampler is None else sampler.walk(logits, proposal)
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
    stats.call_cost = {fed: round(c, 3) for fed, c in sorted(draft.relative.items())}
    return out, stats


def _draft_calls(drafter) -> int:
    model = drafter if isinstance(drafter, ModelDrafter) else getattr(drafter, "model", None)
    return model.calls if isinstance(model, ModelDrafter) else 0
