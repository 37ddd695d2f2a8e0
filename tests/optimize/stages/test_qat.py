"""qat stage: torchao QATConfig prepare -> fine-tune on the shared loop -> convert gives the same
quantized layout as ptq_int8, and a few distillation steps beat PTQ of the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from optimize.losses import kl_to_teacher
from optimize.stage_api import StageContext, get_stage
from optimize.stages.ptq_int8 import Ptq8Config
from optimize.stages.qat import QatConfig

V = 256
TRAIN = torch.randint(0, V, (3000,), generator=torch.Generator().manual_seed(5))
PROBE = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(6))


def tiny():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)  # sharp next-token distributions, so quantization error shows in KL
    return m


def ctx_for(tmp_path, baseline):
    return StageContext(tokenizer=None, calibration=[], train_ids=TRAIN, target=None, work_dir=tmp_path,
                        seed=0, baseline_model=baseline, log=lambda s: None)


def kl(student, teacher) -> float:
    with torch.no_grad():
        return kl_to_teacher(student(input_ids=PROBE).logits, teacher(input_ids=PROBE).logits).item()


def linear_weights(model) -> dict[str, str]:
    return {n: type(m.weight).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_qat_matches_ptq_layout_and_beats_ptq_kl(tmp_path):
    teacher = tiny()
    ptq = get_stage("ptq_int8").fn(copy.deepcopy(teacher), Ptq8Config(scheme="8da4w", group_size=32),
                                   ctx_for(tmp_path, teacher))
    ctx = ctx_for(tmp_path, teacher)
    cfg = QatConfig(scheme="8da4w", group_size=32, steps=20, seq_len=32, batch={"micro_batch_size": 4})
    assert cfg.quant_scheme() == "8da4w"
    qat = get_stage("qat").fn(copy.deepcopy(teacher), cfg, ctx)

    # the converted model is the torchao layout ptq_int8 produces (what ExecuTorch/XNNPACK lowers)
    layout = linear_weights(qat)
    assert layout == linear_weights(ptq)
    assert layout["lm_head"] == "Parameter"  # kept fp32 by default
    quantized = {n: t for n, t in layout.items() if n != "lm_head"}
    assert quantized and set(quantized.values()) == {"IntxUnpackedToInt8Tensor"}
    assert not any("FakeQuantized" in type(m).__name__ for m in qat.modules())

    kl_ptq, kl_qat = kl(ptq, teacher), kl(qat, teacher)
    # QAT starts from the same weights PTQ rounds (before training the fake-quantized model's KL
    # equals PTQ's exactly), then learns around the rounding with KL to the fp32 teacher. Measured:
    # PTQ 0.040, QAT 0.024 after 20 steps at the default lr 5e-5 (0.023-0.030 for lr 2e-5..1e-4).
    # The per-step training loss is too noisy (different batches) to assert on at this size.
    assert kl_qat < 0.8 * kl_ptq, (kl_ptq, kl_qat)
    d = ctx.details
    assert d["scheme"] == "8da4w" and d["group_size"] == 32 and d["loss"] == "distill"
    assert d["linear_quantized"] == len(quantized) and d["kept_modules"] == ["lm_head"]
    assert d["tokens_seen"] == 20 * 4 * 32 and len(d["loss_curve"]) == 20
    assert not qat.training and all(p.grad is None for p in qat.parameters())


def test_qat_lm_loss_8da8w_needs_no_teacher(tmp_path):
    m = tiny()
    ctx = ctx_for(tmp_path, None)
    out = get_stage("qat").fn(m, QatConfig(scheme="8da8w", loss="lm", steps=2, seq_len=32), ctx)
    assert ctx.details["loss"] == "lm" and ctx.details["group_size"] is None
    assert type(out.model.layers[0].mlp.down_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"


def test_bad_values_are_clear(tmp_path):
    with pytest.raises(ValidationError, match="group_size=48 is not a multiple of 32"):
        QatConfig(scheme="8da4w", group_size=48)
    with pytest.raises(ValidationError, match="group_size applies only to scheme 8da4w"):
        QatConfig(scheme="8da8w", group_size=32)
    with pytest.raises(ValidationError, match="with loss: lm it must stay 0"):
        QatConfig(loss="lm", alpha=0.5)
    with pytest.raises(ValidationError, match="scheme\n  Input should be '8da8w' or '8da4w'"):
        QatConfig(scheme="int8wo")

    m = tiny()
    with pytest.raises(ValueError, match=r"qat: pattern\(s\) \['model.layerz.\*'\] match no module"):
        get_stage("qat").fn(m, QatConfig(keep_high_precision=["model.layerz.*"], steps=1, seq_len=32),
                            ctx_for(tmp_path, m))
    with pytest.raises(ValueError, match="qat: no teacher: the pipeline passed no baseline model"):
        get_stage("qat").fn(m, QatConfig(steps=1, seq_len=32), ctx_for(tmp_path, None))
    quantized = get_stage("ptq_int8").fn(tiny(), Ptq8Config(), ctx_for(tmp_path, None))
    with pytest.raises(ValueError, match="qat: .* layer\\(s\\) are already quantized"):
        get_stage("qat").fn(quantized, QatConfig(loss="lm", steps=1, seq_len=32), ctx_for(tmp_path, None))
