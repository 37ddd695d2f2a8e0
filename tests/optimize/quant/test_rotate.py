"""optimize.quant.rotate: the matrices are orthogonal, the folds are exact on every supported
family (norms moved away from their init so a wrong fold shows), ties are kept or untied
deliberately, what cannot be exact is refused, and a rotation really flattens an outlier."""

from __future__ import annotations

import pytest
import torch

from optimize.quant.rotate import RotateRefused, hadamard_available, plan_rotation, rotate_model, rotation_matrix
from tiny_families import FAMILIES, VOCAB, family

#: fp32 rounding of a correct rotation measured 2e-7..8e-7 of the logit scale on these models
TOL = 1e-5
SANDWICH = ("gemma2", "gemma3_text")  # post-block norms: R1 refused, R2 applies


@pytest.mark.parametrize("n,how", [(64, "2^6"), (576, "36 x 16"), (48, "12 x 4"), (100, "random orthogonal"),
                                   (16, "2^4")])
def test_matrices_are_orthogonal(n, how):
    q, desc = rotation_matrix(n, "hadamard", seed=3)
    assert q.shape == (n, n) and q.dtype == torch.float64
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert how in desc
    if hadamard_available(n):  # every entry of a Hadamard matrix has the same magnitude
        assert torch.allclose(q.abs(), torch.full_like(q, n ** -0.5), atol=1e-12)


def test_matrices_are_seeded():
    a, _ = rotation_matrix(64, "hadamard", seed=1)
    b, _ = rotation_matrix(64, "hadamard", seed=1)
    c, _ = rotation_matrix(64, "hadamard", seed=2)
    r, desc = rotation_matrix(64, "random", seed=1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert "random orthogonal" in desc and not torch.allclose(r.abs(), a.abs())


def _logit_diff(model, ids, ref) -> float:
    with torch.no_grad():
        out = model(ids).logits
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_rotation_is_exact_on_every_family(fam, tie):
    model = family(fam, tie_word_embeddings=tie)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    plan = plan_rotation(model)
    r1 = fam not in SANDWICH
    assert (plan.r1_refused is None) == r1, plan.r1_refused
    w_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = rotate_model(model, plan, r1=r1, r2=True, matrix="hadamard", seed=0)
    assert _logit_diff(model, ids, ref) < TOL
    assert res.r2 is not None and (res.r1 is not None) == r1
    changed = [n for n, p in model.named_parameters() if n not in w_before or not torch.equal(p, w_before[n])]
    assert any("v_proj" in n or "qkv_proj" in n for n in changed)  # R2 really moved weights
    if r1:
        assert any("embed_tokens" in n for n in changed)
        # the final norm's perturbed weight is folded into the lm_head, so a tie cannot survive
        assert res.untied == tie
        assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
        assert model.config.tie_word_embeddings is False or not tie
    else:
        assert res.untied is False
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tie


def test_tie_is_kept_when_the_final_norm_is_the_identity():
    model = family("llama", tie_word_embeddings=True)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    res = rotate_model(model, plan_rotation(model), r1=True, r2=True, matrix="hadamard", seed=0)
    assert res.tie_kept and not res.untied
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert _logit_diff(model, ids, ref) < TOL


def test_tied_refuse_policy():
    model = family("qwen2", tie_word_embeddings=True)
    before = model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(RotateRefused, match="tie cannot be kept"):
        rotate_model(model, plan_rotation(model), r1=True, r2=True, matrix="hadamard", seed=0, tied="refuse")
    assert torch.equal(model.model.embed_tokens.weight, before)  # refused before any weight changed


def test_r1_on_sandwich_norms_is_refused():
    model = family("gemma2")
    with pytest.raises(RotateRefused, match="sandwich norms"):
        rotate_model(model, plan_rotation(model), r1=True, r2=False, matrix="hadamard", seed=0)


def test_layernorm_models_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import TINY_CONFIGS

    kw = dict(TINY_CONFIGS["gpt2"])
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))
    with pytest.raises(RotateRefused, match="supported: .*llama"):
        plan_rotation(gpt2)


def test_rotation_flattens_a_residual_outlier():
    """An outlier channel in the attention norm's output (the q/k/v input) is what 4-bit groups
    and int8 tokens cannot take: after R1 the same activation has no channel standing out."""
    model = family("llama")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[5] = 40.0
    seen = {}

    def grab(_m, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs()
        seen["ratio"] = float(x.amax(0).max() / x.amax(0).median())

    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(grab)
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids)
        before = seen["ratio"]
        rotate_model(model, plan_rotation(model), r1=True, r2=False, matrix="hadamard", seed=0)
        model(ids)
    h.remove()
    assert before > 10 and seen["ratio"] < 4, (before, seen["ratio"])
