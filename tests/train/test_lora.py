"""LoRA and QLoRA: only adapters train, NF4 really stores the base, and the merge is exact."""

from __future__ import annotations

import copy

import torch

from train.config import LoRAConfig
from train.lora import apply_lora, merged_state_dict, plain_model


def _randomize_adapters(model):
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; make the adapter do something
            p.data.normal_(0, 0.05)


def _merged_model(peft_model, cfg: LoRAConfig, fresh):
    state = merged_state_dict(peft_model.state_dict(), cfg.alpha, cfg.rank)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return fresh.eval()


def test_lora_merge_parity(tiny_llama):
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8)
    fresh = copy.deepcopy(tiny_llama)
    model = apply_lora(tiny_llama, cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    _randomize_adapters(model)
    ids = torch.randint(0, 49152, (2, 24))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = _merged_model(model, cfg, fresh)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert plain_model(model) is model.base_model.model


def test_qlora_nf4_base_and_merge_parity(tiny_llama):
    from torchao.quantization import NF4Tensor

    cfg = LoRAConfig(enabled=True, rank=4, alpha=8, quantize_base="nf4")
    original = copy.deepcopy(tiny_llama)
    fresh = copy.deepcopy(tiny_llama)
    model = apply_lora(tiny_llama, cfg)
    nf4 = [p for p in model.parameters() if isinstance(p, NF4Tensor)]
    assert len(nf4) == 14  # 7 projections x 2 layers
    assert all(not p.requires_grad for p in nf4)
    _randomize_adapters(model)
    ids = torch.randint(0, 49152, (2, 24))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        merged = _merged_model(model, cfg, fresh)
        got = merged(input_ids=ids).logits
    # merged weights = de-quantized NF4 base + adapter delta: same function as the QLoRA model
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # and the base really was quantized: 4-bit storage, lossy but close to the fp32 original
    from train.lora import dequantize

    base = plain_model(model).model.layers[0].self_attn.q_proj.base_layer.weight
    assert base.quantized_data.dtype == torch.uint8 and base.quantized_data.numel() == base.numel() // 2
    w = original.model.layers[0].self_attn.q_proj.weight
    err = (dequantize(base) - w).norm() / w.norm()
    assert 1e-4 < err < 0.2, err
