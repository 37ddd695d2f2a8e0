"""Sampled decoding: transformers' warping, one draw per emitted token, and speculative sampling that
follows the target's distribution (a chi-square test against the exact distribution, with a wrong
rule as its control) and emits plain sampling's tokens with the same seed."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from export.decoding.runtime import generate_ids
from export.decoding.sampling import CANDIDATE_WEIGHT, Sampling, TokenSampler
from export.decoding.speculative import NgramDrafter, speculative_generate
from tests.export.conftest import fixed_policy, scripted_runner


def _reference(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """transformers' warpers in generate's order (temperature, top-k, top-p), softmaxed; in float64, where
    top-p's running sum is exact enough to agree on the cut (in float32 over 49k flat weights it moves
    the cut by a few tokens)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float().double()[None]
    scores = TemperatureLogitsWarper(s.temperature)(None, scores)
    if s.top_k is not None:
        scores = TopKLogitsWarper(s.top_k)(None, scores)
    if s.top_p is not None:
        scores = TopPLogitsWarper(s.top_p)(None, scores)
    return scores.softmax(-1)[0].double()


def _dense(ids, probs, vocab: int) -> np.ndarray:
    out = np.zeros(vocab)
    out[np.arange(vocab) if ids is None else ids] = probs
    return out


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6, top_k=20), dict(temperature=1.3, top_p=0.8),
                                dict(temperature=0.8, top_k=50, top_p=0.95), dict(temperature=2.0, top_p=0.3),
                                dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-9)])
@pytest.mark.parametrize("vocab", [7, 512, 49152])
def test_the_distribution_is_transformers_warping(kw, vocab):
    """Against transformers' own warpers (tolerance 1e-5 relative, 1e-9 absolute: our weights are float32,
    as generate's are): the kept tokens and their probabilities, on peaked, flat and tied logits, and on one
    token far above a heavy tail (where top-k and top-p must look past the tokens within 1e-3 of the top)."""
    g = torch.Generator().manual_seed(vocab)
    tail = torch.full((vocab,), math.log(1e-4))
    tail[vocab // 3] = 0.0
    rows = [torch.randn(vocab, generator=g) * 4, torch.randn(vocab, generator=g) * 0.05,
            torch.randint(0, 3, (vocab,), generator=g).float(), tail + torch.randn(vocab, generator=g) * 1e-3]
    s = Sampling(**kw)
    for row in rows:
        want = _reference(row, s).numpy()
        ids, probs = s.distribution(row.numpy())
        got = _dense(ids, probs, vocab)
        if row.unique().numel() < vocab:  # which of tied tokens a cut keeps is torch.sort's whim; ours: the lowest ids
            got, want = np.sort(got), np.sort(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
        assert (got > 0).sum() == (want > 0).sum()
        if ids is not None:  # the walk's order: descending probability, ties by token id
            assert np.all(np.diff(probs) <= 0) and len(set(ids.tolist())) == ids.size
    heavy = s.weights(rows[3].numpy())[1]
    if vocab == 49152 and (kw.get("top_p") == 0.8 or kw.get("top_k") == 20):  # looked past the first candidates
        assert (heavy < CANDIDATE_WEIGHT).sum() > 0


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=True), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(seed=-1), "seed"), (dict(seed="7"), "seed")])
def test_bad_settings_are_refused_with_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kw)


def test_non_finite_logits_are_refused():
    with pytest.raises(ValueError, match="no finite maximum"):
        TokenSampler(Sampling(seed=0)).choose(np.array([np.nan, 1.0, 2.0]))


def test_a_seed_fixes_the_tokens_and_draws_follow_the_probabilities():
    row = np.log(np.array([0.5, 0.3, 0.2]))
    a, b = TokenSampler(Sampling(seed=3)), TokenSampler(Sampling(seed=3))
    draws = [a.choose(row) for _ in range(20_000)]
    assert draws[:50] == [b.choose(row) for _ in range(50)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.015)  # 4.5 standard errors at n=20k


VOCAB = 6
#: a second-order Markov model: logits of the next token given the last two, fixed random numbers
TABLE = torch.randn(VOCAB, VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 1.5


def _markov():
    """A model whose next-token logits depend on the last two tokens (every position's logits, exact
    cut-back): its exact distribution over continuations is a product of table rows."""
    return scripted_runner(lambda history: TABLE[history[-2] if len(history) > 1 else 0, history[-1]])


class _Guessing:
    """A drafter that proposes a random token sequence (right by chance): rejections at every depth."""

    def __init__(self, seed: int):
        self.g = np.random.default_rng(seed)

    def extend(self, tokens):
        pass

    def draft(self, context, room, policy):
        return self.g.integers(0, VOCAB, size=min(room, 3)).tolist(), "guess"


def _exact(prompt: list[int], n: int, s: Sampling) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=n):
        ctx, p = list(prompt), 1.0
        for t in seq:
            ids, probs = s.distribution(TABLE[ctx[-2], ctx[-1]].numpy())
            p *= _dense(ids, probs, VOCAB)[t]
            ctx.append(t)
        out[seq] = p
    return out


def _chi2_pvalue(counts: dict, expected: dict[tuple, float], n: int) -> float:
    """Pearson's goodness of fit, cells with fewer than 5 expected merged into one."""
    small = [k for k, p in expected.items() if p * n < 5]
    obs = [counts.get(k, 0) for k, p in expected.items() if p * n >= 5] + [sum(counts.get(k, 0) for k in small)]
    exp = [p * n for p in expected.values() if p * n >= 5] + [sum(expected[k] for k in small) * n]
    obs, exp = np.array(obs, dtype=float), np.array(exp)
    keep = exp > 0
    assert sum(counts.values()) == n and not (obs[~keep] > 0).any()  # no mass where the target puts none
    stat, df = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_speculative_sampling_follows_the_target_distribution(kw, monkeypatch):
    """3 tokens after a prompt, 6,000 seeds, drafts from prompt lookup and from random guesses: the
    continuations' frequencies fit the exact distribution (p > 0.001), every seed's tokens are plain
    sampling's, and drafts were both kept and rejected. The control: accepting a draft whenever the
    target gives it at least 0.25 fails the same test (p < 1e-6), so the test can tell."""
    runner, prompt, n, seeds = _markov(), [0, 1, 2, 0, 1, 2, 0, 1], 3, 6000
    s0 = Sampling(**kw)
    exact = _exact(prompt, n, s0)
    counts: dict = {}
    drafted = accepted = 0
    for seed in range(seeds):
        s = Sampling(**{**kw, "seed": seed})
        drafter = NgramDrafter() if seed % 2 else _Guessing(seed)
        out, stats = speculative_generate(runner, prompt, n, sampling=s, drafter=drafter,
                                          draft=fixed_policy(cost_per_token=0.01, prior_acceptance=0.9))
        if seed < 300:
            assert out == generate_ids(runner, prompt, n, sampling=s), seed
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 500 < accepted < drafted - 500, (accepted, drafted)  # many kept, many rejected
    assert _chi2_pvalue(counts, exact, seeds) > 1e-3

    def lenient(self, logits, proposal):  # keeps any draft the target finds plausible: a biased rule
        rows, chosen = logits.numpy(), []
        for i, x in enumerate(proposal):
            ids, probs = self.sampling.distribution(rows[i])
            if _dense(ids, probs, VOCAB)[x] >= 0.25:
                self._rng.random()
                chosen.append(x)
                continue
            chosen.append(self.choose(rows[i]))
            if chosen[-1] != x:
                return chosen
        return [*chosen, self.choose(rows[len(proposal)])]

    monkeypatch.setattr(TokenSampler, "walk", lenient)
    biased: dict = {}
    for seed in range(seeds):
        out, _ = speculative_generate(runner, prompt, n, sampling=Sampling(**{**kw, "seed": seed}),
                                      drafter=NgramDrafter() if seed % 2 else _Guessing(seed),
                                      draft=fixed_policy(cost_per_token=0.01, prior_acceptance=0.9))
        biased[tuple(out)] = biased.get(tuple(out), 0) + 1
    assert _chi2_pvalue(biased, exact, seeds) < 1e-6
