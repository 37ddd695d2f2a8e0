"""The exporter's own quantization by layer type: ``attention`` sets the attention projections'
precision beside the body's, across families whose attention modules are named differently."""

from __future__ import annotations

import pytest
import torch

from export.executorch.options import ExecuTorchOptions
from export.executorch.quant import apply_quantization, is_attention
from export.precision import module_schemes


def _model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3_text", "opt", "gpt_neox"])
def test_attention_int8_beside_an_int4_body(arch, tiny_config):
    """Every Linear under an attention module is 8da8w, every other body Linear 8da4w, lm_head as
    ``lm_head`` says; the quantized model still computes finite logits."""
    model = _model(tiny_config(arch))
    apply_quantization(model, ExecuTorchOptions(quantize="8da4w", group_size=16, attention="8da8w", lm_head="fp32",
                                                 embedding_quantize=None))
    schemes = module_schemes(model)
    attention = {f: s for f, s in schemes.items() if is_attention(f)}
    body = {f: s for f, s in schemes.items() if not is_attention(f) and not f.endswith("lm_head")}
    assert attention and set(attention.values()) == {"8da8w"}, schemes
    assert body and set(body.values()) == {"8da4w"}, schemes
    assert schemes.get("lm_head", schemes.get("embed_out")) == "fp32"
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 100, (1, 8))).logits).all()


def test_attention_fp32_and_same():
    assert is_attention("model.layers.0.self_attn.q_proj") and is_attention("transformer.h.0.attn.c_attn")
    assert is_attention("gpt_neox.layers.1.attention.query_key_value")
    assert not is_attention("model.layers.0.mlp.gate_proj") and not is_attention("lm_head")
    assert not is_attention("model.layers.0.self_attn")  # the module itself, not one of its projections


def test_attention_without_quantize_is_refused():
    with pytest.raises(ValueError, match="attention: 8da8w sets the attention projections' precision .* quantize: none"):
        ExecuTorchOptions(attention="8da8w")
    with pytest.raises(ValueError, match="attention"):
        ExecuTorchOptions(quantize="8da4w", attention="int4")
