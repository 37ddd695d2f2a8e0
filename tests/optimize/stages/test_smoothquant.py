"""The smoothquant and awq stages: exact folds in fp32, report details, and option errors."""

from __future__ import annotations

import pytest
import torch

from optimize import load_config
from optimize.errors import ConfigError
from optimize.stage_api import StageContext, get_stage


def _ctx(tmp_path, n=2):
    g = torch.Generator().manual_seed(3)
    return StageContext(tokenizer=None, calibration=[torch.randint(0, 1000, (64,), generator=g) for _ in range(n)],
                        train_ids=torch.zeros(0, dtype=torch.long), target=None, work_dir=tmp_path)


@pytest.mark.parametrize("kind,params", [("smoothquant", {"alpha": 0.8}), ("awq", {"rows": 32})])
def test_stage_is_exact_in_fp32_and_reports(tiny_llama, tiny_cfg, tmp_path, kind, params):
    tiny_cfg["stages"] = [{"kind": kind, **params}]
    cfg = load_config(tiny_cfg).stages[0]
    tiny_llama.eval()
    ids = torch.randint(0, 1000, (1, 32))
    with torch.no_grad():
        ref = tiny_llama(ids).logits
        ctx = _ctx(tmp_path)
        out = get_stage(kind).fn(tiny_llama, cfg, ctx)(ids).logits
    assert (out - ref).abs().max() < 1e-5
    assert ctx.details["fold"].startswith("exact")
    if kind == "smoothquant":
        assert ctx.details["fold_groups"] == 8 and ctx.details["alpha"] == 0.8
    else:
        assert ctx.details["groups"] == 8 and ctx.details["calibration_output_error_reduction"] >= 0


def test_smoothquant_then_8da8w_pipeline(tiny_cfg):
    from optimize import run_pipeline

    tiny_cfg["stages"] = [{"kind": "smoothquant", "alpha": 0.5}, {"kind": "ptq_int8", "scheme": "8da8w"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok
    sq = report.row("0:smoothquant")
    assert sq.details["folds"] == ["qkv", "gate_up", "down", "o"]
    assert abs(sq.metrics.kl_divergence) < 1e-4  # fp32 fold: the same model


@pytest.mark.parametrize(
    "stage,message",
    [
        ({"kind": "smoothquant", "alpha": 1.5}, "less than or equal to 1"),
        ({"kind": "smoothquant", "folds": ["qkv", "qkv"]}, "lists a fold twice"),
        ({"kind": "smoothquant", "folds": ["attn"]}, "'qkv', 'gate_up', 'down' or 'o'"),
        ({"kind": "smoothquant", "calibration_windows": 0}, "greater than or equal to 1"),
        ({"kind": "awq", "group_size": 48}, "not a multiple of 32"),
        ({"kind": "awq", "weight_qparams": "gptq"}, "'affine' or 'hqq_scale_only'"),
        ({"kind": "awq", "rows": 4}, "greater than or equal to 16"),
        ({"kind": "awq", "scheme": "int4"}, "'8da4w', 'w4' or '8da8w'"),
    ],
)
def test_bad_values_say_what_is_wrong(tiny_cfg, stage, message):
    tiny_cfg["stages"] = [stage]
    with pytest.raises(ConfigError, match=message):
        load_config(tiny_cfg)


def test_stages_need_calibration(tiny_llama, tiny_cfg, tmp_path):
    for kind in ("smoothquant", "awq"):
        tiny_cfg["stages"] = [{"kind": kind}]
        cfg = load_config(tiny_cfg).stages[0]
        with pytest.raises(ValueError, match="needs calibration text"):
            get_stage(kind).fn(tiny_llama, cfg, _ctx(tmp_path, n=0))
    tiny_cfg["stages"] = [{"kind": "awq", "keep_high_precision": ["model.nope"]}]
    with pytest.raises(ValueError, match=r"pattern\(s\) \['model.nope'\] match no module"):
        get_stage("awq").fn(tiny_llama, load_config(tiny_cfg).stages[0], _ctx(tmp_path))


# ---------------------------------------------------------------------------------------------
# exactness is proven on calibration windows, per family; unsupported models are refused early


def _family_ctx(tmp_path, n=2):
    g = torch.Generator().manual_seed(3)
    return StageContext(tokenizer=None, calibration=[torch.randint(0, 512, (64,), generator=g) for _ in range(n)],
                        train_ids=torch.zeros(0, dtype=torch.long), target=None, work_dir=tmp_path)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text", "phi3", "qwen3"])
@pytest.mark.parametrize("kind", ["smoothquant", "awq"])
def test_stage_is_exact_on_gemma_phi3_qwen3(tmp_path, kind, model_type):
    """The Gemma bug: smoothquant took a Gemma model's perplexity from 37.6 to 66571 and passed."""
    from tiny_families import family

    model = family(model_type)
    spec = get_stage(kind)
    cfg = spec.config_cls.model_validate({"kind": kind, **({"rows": 32} if kind == "awq" else {})})
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(9))
    ctx = _family_ctx(tmp_path)
    with torch.no_grad():
        ref = model(ids).logits
        out = spec.fn(model, cfg, ctx)(ids).logits
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    exact = ctx.details["exactness"]
    assert exact["relative_diff"] <= 1e-5 and exact["tolerance"] == 1e-4 and exact["tokens"] == 128


@pytest.mark.parametrize("kind", ["smoothquant", "awq"])
def test_a_fold_that_is_not_exact_stops_the_stage(tmp_path, monkeypatch, kind):
    """Simulate the old fold (Gemma's 1 + w norm scaled as if it were w): the check refuses it."""
    import optimize.quant.equalize as eq
    from optimize.rewrites.exactness import FoldNotExact
    from tiny_families import family

    monkeypatch.setattr(eq, "norm_offset", lambda norm, name: 0.0)
    spec = get_stage(kind)
    cfg = spec.config_cls.model_validate({"kind": kind, **({"rows": 32} if kind == "awq" else {})})
    with pytest.raises(FoldNotExact, match=rf"{kind} \(folds qkv, gate_up, down, o\) is not exact on this model: "
                                           r"logits moved by up to .* above the tolerance 0.0001"):
        spec.fn(family("gemma2"), cfg, _family_ctx(tmp_path))


def test_pipeline_stops_when_the_fold_is_not_exact(tiny_cfg, monkeypatch):
    import optimize.quant.equalize as eq
    from optimize import run_pipeline

    tiny_cfg["model"]["config"] = {**tiny_cfg["model"]["config"], "model_type": "gemma2", "head_dim": 16,
                                   "tie_word_embeddings": True}
    tiny_cfg["stages"] = [{"kind": "smoothquant"}]
    cfg = load_config(tiny_cfg)
    # the old fold: w / s on a norm computing x * (1 + w) (random Gemma norms start at w = 0, so
    # the norm is left unchanged while the projections are scaled)
    monkeypatch.setattr(eq, "norm_offset", lambda norm, name: 0.0)
    report = run_pipeline(cfg, say=lambda m: None)
    assert not report.ok and report.rows[-1].status == "error"
    assert report.rows[-1].error.startswith("FoldNotExact: smoothquant (folds qkv, gate_up, down, o) is not exact")


@pytest.mark.parametrize(
    "stage,model,message",
    [
        ({"kind": "smoothquant"}, dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=49152),
         r"architecture 'gpt2' has no equalization fold layout \(which norm feeds which projections\); supported: "
         r"gemma, gemma2, gemma3_text, llama, mistral, mixtral, phi3, qwen2, qwen3"),
        ({"kind": "awq"}, dict(model_type="opt", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               ffn_dim=128, vocab_size=49152, word_embed_proj_dim=64),
         "architecture 'opt' has no equalization fold layout"),
        ({"kind": "awq", "group_size": 64, "keep_high_precision": []}, {"intermediate_size": 96},
         r"group_size=64 does not divide the in_features of 2 layer\(s\), e\.g\. model\.layers\.0\.mlp\.down_proj "
         r"\(in_features=96\).*fit every layer: 32$"),
        ({"kind": "awq", "keep_high_precision": ["lm_haed"]}, {},
         r"keep_high_precision pattern\(s\) \['lm_haed'\] match no module of LlamaForCausalLM"),
    ],
)
def test_refused_at_validation_from_the_config(tiny_cfg, stage, model, message):
    if "model_type" in model:
        tiny_cfg["model"]["config"] = model
    else:
        tiny_cfg["model"]["config"] = {**tiny_cfg["model"]["config"], **model}
    tiny_cfg["stages"] = [stage]
    with pytest.raises(ConfigError, match=rf"stages\.0: stage '0:{stage['kind']}': " + message):
        load_config(tiny_cfg)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text", "phi3", "qwen3", "mistral", "qwen2"])
def test_supported_families_pass_validation(tiny_cfg, model_type):
    tiny_cfg["model"]["config"] = {**tiny_cfg["model"]["config"], "model_type": model_type, "head_dim": 16,
                                   "pad_token_id": 0}
    tiny_cfg["stages"] = [{"kind": "smoothquant"}, {"kind": "awq"}]
    assert len(load_config(tiny_cfg).stages) == 2


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("kind", ["smoothquant", "awq"])
def test_stage_on_a_device_folds_as_on_the_cpu(tmp_path, kind, model_type, device):
    """With the model placed on ``device`` (as the pipeline does) and CPU calibration windows,
    the stage gathers its statistics there and folds exactly.

    SmoothQuant's scales are a formula of the statistics: the same weights as on the CPU. AWQ's
    exponent is a search over int4 fake-quant errors: on an H200 its statistics matched the CPU's
    to 1e-7 (TF32 off), yet the errors per exponent differed by 1-10% and the chosen exponents in
    about half the groups of these random models; most likely rounding ties (a group's largest
    negative weight lands on -7.5 exactly, so the last bit of its scale decides -8 or -7). What
    must hold on any device is an exact fold that never does worse than round-to-nearest on its rows."""
    import copy

    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    from optimize.stages.awq import AwqConfig
    from optimize.stages.smoothquant import SmoothQuantConfig

    base = family(model_type)
    probe = torch.randint(1, 500, (1, 32), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = base(probe).logits
    cfg = AwqConfig(rows=32, keep_high_precision=[]) if kind == "awq" else SmoothQuantConfig(alpha=0.8)
    ran = {}
    for where in ("cpu", device):
        ctx = _ctx(tmp_path)
        ctx.calibration = [w % 500 for w in ctx.calibration]
        ctx.device = torch.device(where)
        model = get_stage(kind).fn(copy.deepcopy(base).to(where), cfg, ctx)
        assert all(p.device.type == where for p in model.parameters())
        with torch.no_grad():
            torch.testing.assert_close(model(probe.to(where)).logits.cpu(), ref, rtol=1e-4, atol=1e-4)
        ran[where] = (model.cpu(), ctx.details)
    (cpu_model, cpu_d), (dev_model, dev_d) = ran["cpu"], ran[device]
    if kind == "awq":
        assert dev_d["groups"] == cpu_d["groups"] > 0
        assert dev_d["calibration_output_error_reduction"] >= 0 and cpu_d["calibration_output_error_reduction"] >= 0
    else:
        for (n, a), b in zip(cpu_model.named_parameters(), dev_model.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)
        assert dev_d["scale_range"] == pytest.approx(cpu_d["scale_range"], rel=1e-4)
