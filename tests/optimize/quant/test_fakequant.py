"""Fake-quant reproduces torchao's eager numerics (so sensitivity and searches transfer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optimize.quant.fakequant import FakeQuantLinear, fake_quantized, qdq_weight, scheme_for


@pytest.mark.parametrize("name,algorithm", [("8da4w", "rtn"), ("8da8w", "rtn"), ("8da4w", "hqq")])
def test_matches_torchao_bit_for_bit(name, algorithm):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    torch.manual_seed(0)
    lin, x = nn.Linear(128, 64), torch.randn(7, 128)
    fq = FakeQuantLinear(lin, scheme_for(name, 32, algorithm))
    kw = {"intx_choose_qparams_algorithm": "hqq_scale_only"} if algorithm == "hqq" else {}
    cfg = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if name == "8da4w" else torch.int8,
        weight_granularity=PerGroup(32) if name == "8da4w" else PerAxis(0), **kw)
    m = nn.Sequential(lin)
    quantize_(m, cfg)
    assert torch.equal(m(x), fq(x))


def test_hqq_beats_rtn_on_weight_reconstruction():
    torch.manual_seed(0)
    w = torch.randn(256, 256) * torch.rand(256, 1)
    err = {a: float((qdq_weight(w, scheme_for("w4", 32, a)) - w).pow(2).sum()) for a in ("rtn", "hqq")}
    assert err["hqq"] < 0.95 * err["rtn"]


def test_fake_quantized_restores_and_leaves_tied_head(tiny_llama):
    ids = torch.randint(0, 1000, (1, 16))
    ref = tiny_llama(ids).logits
    with fake_quantized(tiny_llama, ["model.embed_tokens"], scheme_for("8da8w")):
        assert isinstance(tiny_llama.lm_head, nn.Linear)  # the head was not swapped
        assert not torch.equal(tiny_llama(ids).logits, ref)
    assert torch.equal(tiny_llama(ids).logits, ref)
    assert tiny_llama.lm_head.weight is tiny_llama.model.embed_tokens.weight


def test_bad_scheme_and_group_size_messages():
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        scheme_for("int3")
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=64"):
        qdq_weight(torch.randn(4, 64), scheme_for("w4", 48))
    with pytest.raises(TypeError, match="only nn.Linear and nn.Embedding"):
        with fake_quantized(nn.Sequential(nn.ReLU()), ["0"], scheme_for("8da8w")):
            pass
