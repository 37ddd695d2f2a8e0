"""Speculative greedy decoding gives plain greedy decoding's tokens, with fewer forward calls where
the drafts are right.

Every equality here is exact: the same token ids as :func:`export.decoding.runtime.greedy_generate` on the
same runner, for Llama, Qwen2 and Gemma tiny models, with the stops plain decoding has (an EOS id,
``max_new_tokens``, a cache that fills up at ``max_seq_len``)."""

from __future__ import annotations

import pytest
import torch

from export.decoding.runtime import EagerRunner, RunnerError, generate_ids, greedy_generate
from export.decoding.sampling import Sampling
from export.decoding.speculative import DraftLength, NgramDrafter, SpeculativeStats, speculative_generate
from tests.export.conftest import fixed_policy as _fixed, scripted_runner


class _Declining(NgramDrafter):
    """Prompt lookup under a policy that never verifies (a source that starts out of favour)."""

    def __init__(self):
        super().__init__()
        self.offered = 0

    def draft(self, context, room, policy):
        proposal, source = super().draft(context, room, policy)
        self.offered += self.declined is not None
        return proposal, source


def _counting():
    """A model that always says "the last token plus one" (every position's logits; exact cut-back)."""
    return scripted_runner(lambda history: torch.nn.functional.one_hot(torch.tensor((history[-1] + 1) % 64), 64).float())


def test_the_loop_feeds_declined_proposals_back_to_the_policy():
    """With acceptance far too low to draft, an answer that copies the prompt is found by the free checks:
    the policy drafts again within the generation, and the output stays plain greedy's."""
    runner, prompt = _counting(), [*range(40), 0, 1, 2]  # the answer counts on: 3, 4, 5, ... as the prompt did
    policy = _fixed(prior_acceptance=0.02, cost_per_token=0.05, probe_every=10_000)
    drafter = _Declining()
    out, stats = speculative_generate(runner, prompt, 30, drafter=drafter, draft=policy)
    assert out == greedy_generate(runner, prompt, 30) == list(range(3, 33))
    assert drafter.offered > 0 and stats.accepted > 20 and stats.calls < 15, stats


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma"])
def family_model(request):
    from tests.conftest import TINY_CONFIGS
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_CONFIGS[request.param])
    model_type = cfg.pop("model_type")
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**cfg, "vocab_size": 512, "initializer_range": 0.2})
    return request.param, AutoModelForCausalLM.from_config(config).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(3, 512, (40,), generator=g).tolist()
    passage = torch.randint(3, 512, (12,), generator=g).tolist()
    return [rand, passage * 3, passage + rand[:9] + passage[:6], rand[:5]]


@pytest.mark.parametrize("max_seq_len, max_new", [(None, 48), (60, 200)])
def test_the_same_tokens_as_plain_greedy(family_model, max_seq_len, max_new):
    family, model = family_model
    runner = EagerRunner(model, max_seq_len=max_seq_len)
    total = SpeculativeStats()
    for prompt in _prompts():
        if max_seq_len is not None and len(prompt) >= max_seq_len:
            continue
        plain = greedy_generate(runner, prompt, max_new)
        # drafts priced cheap, so they keep coming: the equality is over many verified drafts
        fast, stats = speculative_generate(runner, prompt, max_new, draft=_fixed(cost_per_token=0.05))
        assert fast == plain, (family, prompt[:6])
        if max_seq_len is not None:  # ran until the cache was full, as plain decoding does
            assert len(plain) == max_seq_len - len(prompt) + 1
        total.accepted += stats.accepted
        total.calls += stats.calls
        total.tokens += stats.tokens
    # the drafts were used (not a vacuous equality): tiny random models repeat themselves
    assert total.accepted > 0 and total.tokens_per_call > 1.0, (family, total)


def test_sampled_the_same_tokens_as_plain_sampling_with_the_seed(family_model):
    """Sampled (export.decoding.sampling), speculative decoding emits exactly what plain sampling emits with the
    same seed, to the end of a short cache and past EOS-free stops, with drafts both kept and cut back."""
    family, model = family_model
    runner = EagerRunner(model, max_seq_len=60)
    drafted = accepted = 0
    for seed, prompt in enumerate(_prompts() * 2):
        s = Sampling(temperature=0.2, top_k=30, top_p=0.9, seed=seed)
        plain = generate_ids(runner, prompt, 200, sampling=s)
        fast, stats = speculative_generate(runner, prompt, 200, sampling=s, draft=_fixed(cost_per_token=0.05))
        assert fast == plain, (family, seed)
        assert len(plain) == 60 - len(prompt) + 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted, (family, accepted, drafted)
    # a seed is a different answer (the draws matter), and greedy is not what sampling gave
    assert generate_ids(runner, _prompts()[0], 20, sampling=Sampling(seed=1)) != generate_ids(
        runner, _prompts()[0], 20, sampling=Sampling(seed=2))


def test_stops_at_an_eos_id_like_plain_greedy(family_model):
    _, model = family_model
    runner = EagerRunner(model)
    prompt = _prompts()[1]
    plain = greedy_generate(runner, prompt, 40)
    eos = plain[len(plain) // 2]  # a token it emits mid-way
    want = greedy_generate(runner, prompt, 40, eos_token_ids=[eos])
    got, _ = speculative_generate(runner, prompt, 40, eos_token_ids=[eos])
    assert got == want and got[-1] == eos and len(got) < len(plain)


def test_tokens_stream_in_order_as_they_are_kept(family_model):
    _, model = family_model
    runner = EagerRunner(model)
    seen: list[int] = []
    out, stats = speculative_generate(runner, _prompts()[1], 30, on_token=seen.append)
    assert seen == out and stats.tokens == len(out) == 30
    assert set(stats.as_dict()) >= {"tokens", "calls", "drafted", "accepted", "tokens_per_call", "acceptance", "call_cost"}


class _LastOnly(EagerRunner):
    def forward(self, ids, *, all_logits=True):
        return super().forward(ids, all_logits=False)


class _NoCutBack(EagerRunner):
    def truncate(self, n):
        return False


def test_runners_that_cannot_verify_are_refused_with_the_reason(family_model):
    _, model = family_model
    prompt = _prompts()[1]
    with pytest.raises(RunnerError, match="every position's"):
        speculative_generate(_LastOnly(model), prompt, 30)
    with pytest.raises(RunnerError, match="cannot cut its KV cache back"):
        # a random model rejects some draft within 200 tokens: the cut-back is needed
        speculative_generate(_NoCutBack(model), _prompts()[0] * 2, 200, draft=_fixed(prior_acceptance=0.9))


def test_a_runner_without_a_verification_path_refuses_to_decode_speculatively(family_model):
    """Runners whose several-token calls are not bit for bit one-token calls (eager; ONNX Runtime's fused
    graph, whose prefill path and GroupQueryAttention sum in another order) refuse with the reason."""
    _, model = family_model
    with pytest.raises(RunnerError, match="bit for bit"):
        EagerRunner(model).speculative_runner()


def test_the_runner_keeps_its_draft_policy_across_generations(family_model):
    """Without a policy given, the runner's own is made once and kept: the call times and acceptance one
    generation measured serve the next (a short answer would otherwise spend itself learning them)."""
    _, model = family_model
    runner = EagerRunner(model)
    assert runner.draft_policy is None
    speculative_generate(runner, _prompts()[1], 20)
    policy = runner.draft_policy
    assert isinstance(policy, DraftLength) and policy.step_seconds and policy.acceptance
    # the stats carry what a verification call cost on this device, as the policy priced it
    priced = DraftLength()
    priced.timed(1, 0.001)  # a one-token step's time to price against from the first call
    _, stats = speculative_generate(EagerRunner(model), _prompts()[1], 20, draft=priced)
    assert stats.verify_calls > 0 and stats.call_cost == {n: round(c, 3) for n, c in priced.relative.items()}
    assert stats.call_cost and all(n > 1 and c > 0 for n, c in stats.call_cost.items()), stats
    speculative_generate(runner, _prompts()[2], 20)
    assert runner.draft_policy is policy
    assert EagerRunner(model).draft_policy is None  # per runner, not per class


# ---- a draft model's tokens (ModelDrafter, HybridDrafter)


def _draft_of(model, layers: int):
    """A depth-pruned copy of ``model``: its first ``layers`` blocks, its embedding, final norm and head."""
    import copy

    draft = copy.deepcopy(model)
    inner = draft.model
    inner.layers = inner.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft.eval()


@pytest.mark.parametrize("mode", ["model", "hybrid"])
def test_a_draft_model_keeps_plain_greedy_tokens(family_model, mode):
    from export.decoding.speculative import HybridDrafter, ModelDrafter

    family, model = family_model
    runner = EagerRunner(model, max_seq_len=80)
    drafter = ModelDrafter(EagerRunner(_draft_of(model, 1), max_seq_len=80))
    if mode == "hybrid":
        drafter = HybridDrafter(drafter)
    total = SpeculativeStats()
    for prompt in _prompts():
        plain = greedy_generate(runner, prompt, 60)
        fast, stats = speculative_generate(runner, prompt, 60, drafter=drafter,
                                           draft=_fixed(cost_per_token=0.05, draft_cost_prior=0.05))
        assert fast == plain, (family, mode, prompt[:6])
        for k in ("accepted", "drafted", "calls", "tokens", "draft_calls"):
            setattr(total, k, getattr(total, k) + getattr(stats, k))
    # the draft model drafted, some of its tokens held and some were cut back
    assert total.draft_calls > 0 and 0 < total.accepted < total.drafted, (family, mode, total)


def test_the_draft_follows_the_context_through_cut_backs():
    """After every verification the draft's cache holds a prefix of the context: rejected drafts are cut,
    and what the target emitted is fed with the next draft call."""
    from export.decoding.speculative import ModelDrafter

    torch.manual_seed(0)
    from tests.conftest import TINY_CONFIGS
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_CONFIGS["llama"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **{**cfg, "vocab_size": 512, "initializer_range": 0.2})
    model = AutoModelForCausalLM.from_config(config).eval()
    drafter = ModelDrafter(EagerRunner(_draft_of(model, 1)))
    ctx = _prompts()[0]
    first = drafter.propose(ctx, 4)
    assert len(first) == 4 and drafter.fed == ctx + first[:3] and drafter.runner.position == len(ctx) + 3
    # the target kept two drafts and chose another token: the draft cuts its cache to the kept prefix
    ctx2 = ctx + first[:2] + [(first[2] + 1) % 512]
    second = drafter.propose(ctx2, 2)
    assert drafter.fed == ctx2 + second[:1] and drafter.runner.position == len(ctx2) + 1
    # the same as a draft that starts from nothing on that context
    fresh = ModelDrafter(EagerRunner(_draft_of(model, 1)))
    assert fresh.propose(ctx2, 2) == second
    assert drafter.propose(ctx2, 0) == []


def test_an_unsure_draft_stops_early_and_a_partial_vocabulary_maps_back():
    from export.decoding.speculative import ModelDrafter

    class Fixed(EagerRunner):
        """A draft whose logits say: token 2 (index), sure for three calls, then unsure."""

        def __init__(self):
            super().__init__(torch.nn.Identity())
            self.n = 0

        def forward(self, ids, *, all_logits=True):
            self._pos += int(torch.as_tensor(ids).numel())
            self.n += 1
            logits = torch.zeros(1, 4)
            logits[0, 2] = 10.0 if self.n <= 3 else 0.5
            return logits

        def truncate(self, n):
            self._pos = n
            return True

    d = ModelDrafter(Fixed(), stop_below=0.5, vocab_ids=[7, 8, 9, 11])
    assert d.propose([1, 2, 3], 8) == [9, 9, 9]  # index 2 is token 9; the fourth call was unsure
    with pytest.raises(ValueError):
        ModelDrafter(Fixed(), stop_below=1.0)
