"""Equalization folds (SmoothQuant, AWQ) are exact in fp32 and validate their inputs."""

from __future__ import annotations

import pytest
import torch

from optimize.quant.awq import awq_scale, linear_error
from optimize.quant.equalize import ALL_FOLDS, apply_fold, fold_groups
from optimize.quant.fakequant import fake_quantized, scheme_for
from optimize.quant.smoothquant import smooth, smooth_scales
from tiny_families import FAMILIES, family  # tests/optimize is on sys.path (its conftest)


def _calib(n=2, length=48):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (length,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("folds", [("qkv", "gate_up"), ALL_FOLDS])
def test_smoothquant_fold_is_exact_in_fp32(tiny_llama, folds):
    tiny_llama.eval()
    ids = torch.randint(0, 1000, (1, 32))
    with torch.no_grad():
        ref = tiny_llama(ids).logits
        res = smooth(tiny_llama, _calib(), alpha=0.5, folds=folds)
        out = tiny_llama(ids).logits
    assert res.groups == 2 * len(folds)
    assert (out - ref).abs().max() < 1e-5
    assert res.scale_range[0] != 1.0 or res.scale_range[1] != 1.0  # something was rescaled


def test_o_fold_respects_gqa_head_sharing(tiny_llama):
    """4 query heads share 2 KV heads: o_proj columns repeat v_proj's scales per KV head."""
    tiny_llama.eval()
    ids = torch.randint(0, 1000, (1, 20))
    (g,) = [g for g in fold_groups(tiny_llama, ["o"]) if g.source.startswith("model.layers.0.")]
    assert g.repeat == 2
    with torch.no_grad():
        ref = tiny_llama(ids).logits
        apply_fold(tiny_llama, g, torch.rand(32) * 4 + 0.1)
        assert (tiny_llama(ids).logits - ref).abs().max() < 1e-5


def test_smoothquant_reduces_static_int8_error_on_outliers():
    """With an outlier activation channel, per-tensor activation error drops after smoothing."""
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x[:, 3] *= 60
    w = torch.randn(32, 64) * 0.1
    s = smooth_scales(x.abs().amax(0), [w], alpha=0.5)

    def per_tensor_err(xx, ww):
        sc = xx.abs().max() / 127
        return float(((torch.round(xx / sc) * sc) @ ww.t() - x @ w.t()).pow(2).mean())

    assert per_tensor_err(x / s, w * s) < 0.5 * per_tensor_err(x, w)


def test_awq_beats_rtn_on_reconstruction_and_keeps_fp32_logits(tiny_llama):
    tiny_llama.eval()
    with torch.no_grad():
        for layer in tiny_llama.model.layers:  # salient input channels, as in real LLMs
            layer.input_layernorm.weight[[5, 17]] = 25.0
            layer.post_attention_layernorm.weight[[9]] = 25.0
        ids = torch.randint(0, 1000, (1, 24))
        ref = tiny_llama(ids).logits
        names = [n for n, m in tiny_llama.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
        sch = scheme_for("8da4w", 32)
        with fake_quantized(tiny_llama, names, sch):
            err_rtn = float((tiny_llama(ids).logits - ref).pow(2).mean())
        res = awq_scale(tiny_llama, _calib(), sch, rows=64)
        assert (tiny_llama(ids).logits - ref).abs().max() < 1e-4  # the fold is exact
        assert res.error_awq < res.error_rtn
        with fake_quantized(tiny_llama, names, sch):
            err_awq = float((tiny_llama(ids).logits - ref).pow(2).mean())
    assert err_awq < err_rtn


def test_linear_error_is_relative():
    w = torch.randn(8, 64)
    assert 0 < linear_error(torch.randn(10, 64), w, scheme_for("w4", 32)) < 0.1


def test_bad_values_say_what_is_wrong(tiny_llama):
    with pytest.raises(ValueError, match=r"alpha=1.5 must lie in \[0, 1\]"):
        smooth(tiny_llama, _calib(), alpha=1.5)
    with pytest.raises(ValueError, match="unknown fold kind"):
        fold_groups(tiny_llama, ["qk"])
    with pytest.raises(ValueError, match="needs calibration windows"):
        smooth(tiny_llama, [], alpha=0.5)
    g = fold_groups(tiny_llama, ["qkv"])[0]
    with pytest.raises(ValueError, match="3 scales for 64 channels"):
        apply_fold(tiny_llama, g, torch.ones(3))
    with pytest.raises(ValueError, match="finite and positive"):
        apply_fold(tiny_llama, g, torch.zeros(64))
    with pytest.raises(ValueError, match="at least 16 calibration rows"):
        awq_scale(tiny_llama, _calib(), scheme_for("8da4w"), rows=4)
    with pytest.raises(ValueError, match="has no transformers config"):
        fold_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)))


# ---------------------------------------------------------------------------------------------
# every supported family: the folds follow its layout (Gemma's 1 + w norms, Gemma2/3's
# pre-feedforward norm, Phi-3's fused projections, Qwen3/Gemma3's q/k norms) and stay exact


def _rel_diff(model, fn) -> float:
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
        fn(model)
        return float((model(ids).logits - ref).abs().max() / ref.abs().max())


def _calib512(n=2, length=48):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (length,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_smoothquant_and_awq_are_exact_on_every_supported_family(model_type):
    # before the layouts, gemma/gemma2/gemma3_text moved logits by 50-90% of their scale here
    rel = _rel_diff(family(model_type), lambda m: smooth(m, _calib512(), alpha=0.8, folds=ALL_FOLDS))
    assert rel < 1e-5, f"{model_type}: smoothquant moved logits by {rel:.3g} of their scale"
    res = None

    def run_awq(m):
        nonlocal res
        res = awq_scale(m, _calib512(), scheme_for("8da4w", 32), rows=32)

    rel = _rel_diff(family(model_type), run_awq)
    assert rel < 1e-5, f"{model_type}: awq moved logits by {rel:.3g} of their scale"
    assert any(a > 0 for a in res.alphas.values())  # something was rescaled


def test_fold_targets_follow_each_layout():
    from optimize.quant.equalize import channels

    g2 = {g.kind: g for g in fold_groups(family("gemma2"), ALL_FOLDS)[:4]}
    # Gemma2's post_attention_layernorm normalises the attention output; the MLP reads pre_feedforward_layernorm
    assert g2["gate_up"].source == "model.layers.0.pre_feedforward_layernorm"
    assert g2["qkv"].source == "model.layers.0.input_layernorm"
    phi3 = family("phi3")
    groups = {g.kind: g for g in fold_groups(phi3, ALL_FOLDS)[:4]}
    assert groups["qkv"].linears == ["model.layers.0.self_attn.qkv_proj"]
    # rows q (4 heads) | k (2) | v (2) of 16: v is rows 96..128; up is the second half of gate_up
    assert groups["o"].source == "model.layers.0.self_attn.qkv_proj" and groups["o"].rows == (96, 128)
    assert groups["down"].source == "model.layers.0.mlp.gate_up_proj" and groups["down"].rows == (128, 256)
    assert channels(phi3, groups["o"]) == 32 and channels(phi3, groups["down"]) == 128


def test_norm_offset_is_measured_not_assumed():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from optimize.quant.fold_layouts import FoldRefused, norm_offset

    gemma, llama = GemmaRMSNorm(8), LlamaRMSNorm(8)
    with torch.no_grad():
        gemma.weight.normal_()
        llama.weight.normal_()
    before = gemma.weight.detach().clone()
    assert norm_offset(gemma, "g") == 1.0 and norm_offset(llama, "l") == 0.0
    assert norm_offset(torch.nn.LayerNorm(8), "ln") == 0.0
    assert torch.equal(gemma.weight, before)  # the probe puts the weight back bit for bit

    class Squared(torch.nn.Module):  # a norm whose scale is not affine in its weight
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x):
            return x * self.weight**2

    with pytest.raises(FoldRefused, match=r"q \(Squared\) does not compute n\(x\) \* w or n\(x\) \* \(1 \+ w\)"):
        norm_offset(Squared(), "q")


def test_unsupported_layouts_are_refused_with_the_reason():
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimize.quant.fold_layouts import FoldRefused

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=512))
    with pytest.raises(FoldRefused, match=r"architecture 'gpt2' has no equalization fold layout .*supported: gemma, "
                                          r"gemma2, gemma3_text, llama, mistral, mixtral, phi3, qwen2, qwen3"):
        fold_groups(gpt2)
    model = family("qwen3")
    model.model.layers[1].self_attn.v_norm = torch.nn.Identity()  # a value norm (as in Gemma3n)
    fold_groups(model, ("qkv", "gate_up", "down"))  # the other folds do not touch v
    with pytest.raises(FoldRefused, match=r"model.layers.1.self_attn normalises v \(v_norm\).*drop the 'o' fold"):
        fold_groups(model, ("o",))
