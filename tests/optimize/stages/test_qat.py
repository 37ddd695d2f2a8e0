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
    with pytest.raises(ValidationError, match="int8_modules applies only to scheme 8da4w"):
        QatConfig(scheme="8da8w", int8_modules=["lm_head"])

    m = tiny()
    with pytest.raises(ValueError, match=r"qat: pattern\(s\) \['model.layerz.\*'\] match no module"):
        get_stage("qat").fn(m, QatConfig(keep_high_precision=["model.layerz.*"], steps=1, seq_len=32),
                            ctx_for(tmp_path, m))
    with pytest.raises(ValueError, match="qat: no teacher: the pipeline passed no baseline model"):
        get_stage("qat").fn(m, QatConfig(steps=1, seq_len=32), ctx_for(tmp_path, None))
    quantized = get_stage("ptq_int8").fn(tiny(), Ptq8Config(), ctx_for(tmp_path, None))
    with pytest.raises(ValueError, match="qat: .* layer\\(s\\) are already quantized"):
        get_stage("qat").fn(quantized, QatConfig(loss="lm", steps=1, seq_len=32), ctx_for(tmp_path, None))


# ---------------------------------------------------------------- scheme from the target

def _profile(**kw):
    from targets.profile import TargetProfile

    base = dict(name="custom", description="test", exporter="executorch", backend="xnnpack", max_seq_len=64,
                allowed_schemes=["fp32", "8da8w", "8da4w"])
    return TargetProfile(**{**base, **kw})


def test_scheme_comes_from_the_target_when_not_given():
    from targets import load_target

    cfg = QatConfig()
    assert cfg.resolved_scheme(None) == "8da4w" and cfg.quant_scheme() == "8da4w"
    assert cfg.resolved_scheme(load_target("executorch")) == "8da4w"
    assert cfg.resolved_scheme(_profile(allowed_schemes=["fp32", "8da8w"])) == "8da8w"
    assert cfg.resolved_scheme(_profile(export_options={"quantize": "8da8w"})) == "8da8w"
    assert QatConfig(scheme="8da8w").resolved_scheme(load_target("executorch")) == "8da8w"
    assert cfg.check_model(AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                num_key_value_heads=2, num_hidden_layers=2, vocab_size=V),
                           load_target("executorch")) == []


NO_INT4 = dict(refused_schemes={"8da4w": "this device has no int4 kernels"})


def test_target_scheme_mismatch_is_refused(tmp_path):
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=V)
    msg = QatConfig(scheme="8da4w").check_model(config, _profile(**NO_INT4))
    assert msg == ["target 'custom' refuses scheme '8da4w': this device has no int4 kernels"]
    msg = QatConfig(scheme="8da4w").check_model(config, _profile(export_options={"quantize": "8da8w"}))
    assert msg == ["scheme 8da4w does not match target 'custom', whose export quantizes to 8da8w; QAT must train "
                   "for the scheme that ships (set scheme: 8da8w)"]
    msg = QatConfig(scheme="8da4w").check_model(config, _profile(allowed_schemes=["fp32", "8da8w"]))
    assert msg == ["target 'custom' (xnnpack) does not run scheme '8da4w'; allowed: fp32, 8da8w"]
    msg = QatConfig(group_size=64).check_model(config, _profile(allowed_schemes=["fp32", "8da8w"]))
    assert msg == ["group_size and int8_modules apply to 8da4w, but the target resolves the scheme to 8da8w"]
    # the stage refuses too when called without the pipeline's pre-flight
    ctx = ctx_for(tmp_path, None)
    ctx.target = _profile(**NO_INT4, allowed_schemes=["fp32", "8da4w"])
    with pytest.raises(ValueError, match="qat: target 'custom' refuses scheme '8da4w'"):
        get_stage("qat").fn(tiny(), QatConfig(loss="lm", steps=1, seq_len=32), ctx)


def test_validate_refuses_a_scheme_the_target_does_not_run(tiny_cfg, tmp_path):
    import yaml

    from optimize.config import load_config
    from optimize.errors import ConfigError

    profile = tmp_path / "int8_only.yaml"
    profile.write_text(yaml.safe_dump(_profile(**NO_INT4).model_dump()))
    tiny_cfg["stages"] = [{"kind": "qat", "scheme": "8da4w"}]
    tiny_cfg["target"] = str(profile)
    with pytest.raises(ConfigError, match="stages.0.*refuses scheme '8da4w': this device has no int4 kernels"):
        load_config(tiny_cfg)
    tiny_cfg["stages"] = [{"kind": "qat"}]  # no scheme: the target's
    tiny_cfg["target"] = "executorch"
    assert load_config(tiny_cfg).stages[0].resolved_scheme(None) == "8da4w"


def test_int8_modules_train_lm_head_at_8da8w(tmp_path):
    teacher = tiny()
    ctx = ctx_for(tmp_path, teacher)
    cfg = QatConfig(scheme="8da4w", group_size=32, keep_high_precision=[], int8_modules=["lm_head"], steps=2, seq_len=32)
    out = get_stage("qat").fn(copy.deepcopy(teacher), cfg, ctx)
    from export.precision import module_schemes

    schemes = module_schemes(out)
    assert schemes["lm_head"] == "8da8w" and schemes["model.layers.0.mlp.down_proj"] == "8da4w"
    assert ctx.details["int8_modules"] == ["lm_head"] and ctx.details["scheme_from"] == "config"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_qat_model_exports_to_pte_matching_eager(tmp_path):
    """The converted QAT model is ptq_int8's layout, so the .pte reproduces the eager QAT model.
    XNNPACK rounds the dynamic activation scales slightly differently from torchao's eager
    reference (see tests/export/executorch/test_exporter.py); measured here: max diff 0.0077 on logits up
    to 0.85 (0.9%), top-1 agreement 100%. The bound leaves 2x margin."""
    from export.executorch.exporter import ExecuTorchExporter
    from export.decoding.runtime import EagerRunner
    from export.verify import logits_parity
    from targets.sources import RandomSource, load_model

    loaded = load_model(RandomSource(config=dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 vocab_size=49152, max_position_embeddings=256), seed=0))
    teacher = loaded.model.eval()
    train = torch.randint(0, 49152, (3000,), generator=torch.Generator().manual_seed(5))
    ctx = StageContext(tokenizer=None, calibration=[], train_ids=train, target=None, work_dir=tmp_path,
                       baseline_model=teacher, log=lambda s: None)
    cfg = QatConfig(scheme="8da4w", group_size=32, keep_high_precision=[], int8_modules=["lm_head"], steps=3,
                    seq_len=32)
    model = get_stage("qat").fn(copy.deepcopy(teacher), cfg, ctx)
    res = ExecuTorchExporter().export(model, loaded.tokenizer, tmp_path / "et", {"max_seq_len": 64},
                                      log=lambda *a: None)
    assert res.details["quantization"]["linear"] == {"8da4w": 14, "8da8w": 1}
    runner = ExecuTorchExporter().load(res.artifact)
    ids = torch.randint(0, 49152, (63,), generator=torch.Generator().manual_seed(9))
    ref = EagerRunner(model)
    parity = logits_parity(ref, runner, [ids])
    ref.reset()
    scale = float(ref.forward(ids).abs().max())
    assert parity["max_abs_diff"] < 0.02 * scale and parity["top1_agreement"] >= 0.95, (parity, scale)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")])]


@pytest.mark.parametrize("device", DEVICES)
def test_qat_trains_and_converts_where_the_pipeline_placed_the_model(tmp_path, device):
    """On ``device``: the converted layers are torchao's XNNPACK layout there, and QAT beats PTQ's KL."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    teacher = tiny().to(device)
    probe = PROBE.to(device)

    def kl_here(model) -> float:
        with torch.no_grad():
            return kl_to_teacher(model(input_ids=probe).logits, teacher(input_ids=probe).logits).item()

    ctx = ctx_for(tmp_path, teacher)
    ctx.device = torch.device(device)
    ptq = get_stage("ptq_int8").fn(copy.deepcopy(teacher), Ptq8Config(scheme="8da4w", group_size=32), ctx)
    cfg = QatConfig(scheme="8da4w", group_size=32, steps=20, seq_len=32, batch={"micro_batch_size": 4})
    qat = get_stage("qat").fn(copy.deepcopy(teacher), cfg, ctx)
    down = qat.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, IntxUnpackedToInt8Tensor) and down.qdata.device.type == device
    assert kl_here(qat) < 0.8 * kl_here(ptq)
