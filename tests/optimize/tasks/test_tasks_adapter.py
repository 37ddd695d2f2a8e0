"""RunnerLM (our lm-eval LM over a Runner) gives lm-eval's own HFLM log-likelihoods on the same model.

Tolerance: 1e-4 absolute on every summed log-likelihood (nats; the sums here reach a few hundred,
HFLM sums float32 log-probs, we float64), and identical greedy flags."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval", reason="pip install 'lm-eval==0.4.13'")

from export.decoding.runtime import EagerRunner  # noqa: E402
from optimize.tasks.data import missing_packages  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_lm():
    from tests.conftest import TINY_LLAMA
    from targets.sources import RandomSource, load_model

    loaded = load_model(RandomSource(config={**TINY_LLAMA, "initializer_range": 0.2}, seed=0))
    return loaded.model.eval(), loaded.tokenizer


def _hflm(model, tok, **kw):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu", **kw)


def _task_requests(names, n):
    from lm_eval.tasks import TaskManager

    from optimize.tasks.data import task_config

    loaded = TaskManager(include_defaults=False).load([task_config(t, head=n) for t in names])
    reqs = []
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(limit=n, rank=0, world_size=1)
        reqs += task.instances
    return reqs


def _same(ours, ref):
    assert len(ours) == len(ref)
    diff = max(abs(a[0] - b[0]) for a, b in zip(ours, ref))
    assert diff < TOL, f"max |ours - HFLM| = {diff:.3g} nats"
    assert [a[1] for a in ours] == [b[1] for b in ref]
    return diff


@pytest.mark.skipif(bool(missing_packages()), reason="; ".join(missing_packages()))
def test_task_requests_equal_hflm(tiny_lm):
    from optimize.tasks.adapter import RunnerLM

    model, tok = tiny_lm
    reqs = _task_requests(["arc_easy", "hellaswag", "winogrande", "piqa", "boolq"], 2)
    assert len(reqs) >= 20
    ours = RunnerLM(EagerRunner(model), tok, max_length=1024).loglikelihood(reqs, disable_tqdm=True)
    ref = _hflm(model, tok, max_length=1024).loglikelihood(reqs, disable_tqdm=True)
    _same(ours, ref)


def test_empty_context_truncation_greedy_and_rolling_equal_hflm(tiny_lm):
    from optimize.tasks.adapter import RunnerLM, loglikelihoods

    model, tok = tiny_lm
    ours_lm = RunnerLM(EagerRunner(model), tok, max_length=32)
    hf = _hflm(model, tok, max_length=32)
    long_ctx = "The quick brown fox jumps over the lazy dog. " * 8  # > 32 tokens: truncated from the left
    pairs = [("", "Hello world"), ("Question: is it?\nAnswer:", " yes"), ("Question: is it?\nAnswer:", " no"),
             (long_ctx, " And then it ran away."), ("trailing space ", "moves")]
    from lm_eval.api.instance import Instance

    inst = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    _same(loglikelihoods(ours_lm, pairs), hf.loglikelihood(inst, disable_tqdm=True))
    assert ours_lm.stats["truncated"] == 1  # the long context, cut from the left; counted for the report

    # greedy flag true: a continuation made of the model's own argmax tokens
    ctx = tok.encode("Once upon a time")
    runner = EagerRunner(model)
    runner.reset()
    logits = runner.forward(torch.tensor(ctx))
    cont = []
    for _ in range(3):
        cont.append(int(logits[-1].argmax()))
        logits = runner.forward(torch.tensor([cont[-1]]))
    req = [(("a", "b"), ctx, cont), (("a", "c"), ctx, [cont[0], (cont[1] + 1) % 49152])]
    ours = ours_lm._loglikelihood_tokens(req)
    assert [g for _, g in ours] == [True, False]
    _same(ours, hf._loglikelihood_tokens(req, disable_tqdm=True))

    text = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(long_ctx,), idx=0)]
    a, b = ours_lm.loglikelihood_rolling(text), hf.loglikelihood_rolling(text, disable_tqdm=True)
    assert abs(a[0] - b[0]) < TOL


def test_sampling_generation_is_refused_clearly(tiny_lm):
    from lm_eval.api.instance import Instance

    from optimize.tasks.adapter import RunnerLM

    model, tok = tiny_lm
    req = Instance(request_type="generate_until", doc={}, arguments=("Q: hi\nA:", {"do_sample": True,
                                                                                   "temperature": 0.7}), idx=0)
    with pytest.raises(ValueError, match="generation in the runtime is greedy"):
        RunnerLM(EagerRunner(model), tok).generate_until([req])


def test_shared_prefixes_are_cut_back_to_not_fed_again(tiny_lm):
    """Contexts with a common beginning (a few-shot prefix) are taken one after another and the
    runner is cut back to the shared tokens: the same log-likelihoods (1e-5) with fewer tokens fed."""
    from optimize.tasks.adapter import RunnerLM, loglikelihoods

    model, tok = tiny_lm
    shots = "Q: What is two plus two?\nA: four\n\nQ: What colour is the sky?\nA: blue\n\n"
    pairs = [(shots + "Q: What is one plus one?\nA:", " two"), ("Unrelated context here.", " and more"),
             (shots + "Q: What colour is grass?\nA:", " green")]
    shared = RunnerLM(EagerRunner(model), tok)
    got = loglikelihoods(shared, pairs)
    alone = [loglikelihoods(RunnerLM(EagerRunner(model), tok), [p])[0] for p in pairs]
    assert shared.stats["reused"] >= len(tok.encode(shots)) - 1
    for (a, ga), (b, gb) in zip(got, alone):
        assert abs(a - b) <= 1e-5 and ga == gb


def test_one_token_choices_read_the_contexts_last_logits(tiny_lm):
    from optimize.tasks.adapter import RunnerLM, loglikelihoods

    model, tok = tiny_lm
    calls = []

    class Spy(EagerRunner):
        def forward(self, ids, *, all_logits=True):
            calls.append((int(torch.as_tensor(ids).numel()), all_logits))
            return super().forward(ids, all_logits=all_logits)

    lm = RunnerLM(Spy(model), tok)
    loglikelihoods(lm, [("Is the sky blue? Answer:", " yes"), ("Is the sky blue? Answer:", " no")])
    assert len(tok.encode(" yes")) == len(tok.encode(" no")) == 1
    # one prefill of the context, without every position's logits; both choices read its last logits
    assert [a for _, a in calls] == [False] and lm.stats["contexts"] == 1 and lm.stats["runs"] == 0


class _OneByOne(EagerRunner):
    """Choices one at a time, the cache cut back in between (a runtime without a batched path)."""

    def forward_each(self, rests):
        return None


class _NoTruncate(_OneByOne):
    """A runtime that can neither batch nor drop cached positions (the base Runner's answers)."""

    def truncate(self, n):
        return False


def test_choices_share_the_context_and_equal_fresh_runs(tiny_lm):
    """Multi-token choices of one context: the context is fed once, and the choices go as one batch
    (eager's forward_each), or one at a time with the cache cut back in between, or after the context
    fed again: the three give the same log-likelihoods (1e-5 nats), and each equals HFLM's (1e-4)."""
    from optimize.tasks.adapter import RunnerLM, loglikelihoods

    model, tok = tiny_lm
    ctx = "The committee met on Tuesday to decide"
    pairs = [(ctx, " whether the bridge would be rebuilt"), (ctx, " nothing at all, as usual"),
             (ctx, " the budget"), ("Another question entirely:", " and its answer")]
    calls = []

    class Spy(EagerRunner):
        def forward(self, ids, *, all_logits=True):
            calls.append(all_logits)
            return super().forward(ids, all_logits=all_logits)

    batched = RunnerLM(Spy(model), tok)
    got = loglikelihoods(batched, pairs)
    assert batched.stats["contexts"] == 2  # two distinct contexts, each fed once
    # the three choices of the first context in one batched call, the other context's one choice alone
    assert calls.count(False) == 2 and calls.count(True) == 1 and batched.stats["runs"] == 2
    cut = RunnerLM(_OneByOne(model), tok)
    refed = RunnerLM(_NoTruncate(model), tok)
    for other in (cut, refed):
        want = loglikelihoods(other, pairs)
        assert other.stats["contexts"] == 2 and other.stats["runs"] == 4
        for (a, ga), (b, gb) in zip(got, want):
            assert abs(a - b) <= 1e-5 and ga == gb
    assert refed.stats["tokens"] > cut.stats["tokens"] == batched.stats["tokens"]
    ref = _hflm(model, tok).loglikelihood(_instances(pairs), disable_tqdm=True)
    for (a, _), (b, _) in zip(got, ref):
        assert abs(a - b) <= TOL


def test_forward_each_leaves_the_cache_as_it_was(tiny_lm):
    model, _ = tiny_lm
    r = EagerRunner(model)
    ctx, a, b = torch.arange(5, 17), torch.arange(30, 39), torch.arange(50, 53)
    r.reset()
    r.forward(ctx, all_logits=False)
    both = r.forward_each([a, b])
    assert r.position == 12 and [t.shape[0] for t in both] == [9, 3]
    alone = r.forward(b)  # continues from the context, as if forward_each never ran
    assert (alone - both[1]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="at least one token"):
        r.forward_each([a, torch.tensor([], dtype=torch.long)])


def _instances(pairs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
