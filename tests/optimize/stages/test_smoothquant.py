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
