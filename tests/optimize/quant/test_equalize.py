"""Equalization folds (SmoothQuant, AWQ) are exact in fp32 and validate their inputs."""

from __future__ import annotations

import pytest
import torch

from optimize.quant.awq import awq_scale, linear_error
from optimize.quant.equalize import ALL_FOLDS, apply_fold, fold_groups
from optimize.quant.fakequant import fake_quantized, scheme_for
from optimize.quant.smoothquant import smooth, smooth_scales


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
    with pytest.raises(ValueError, match="no Llama-style decoder blocks"):
        fold_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)))
