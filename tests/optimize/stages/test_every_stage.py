"""Every built-in stage: it runs in a real pipeline, keeps output shapes, its config
round-trips through YAML, and its report row is filled.

A new stage must add an entry to EXAMPLES (its parameters and a model it applies to);
the first test fails until it does, so no stage ships untested.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from optimize import load_config, run_pipeline
from optimize.stage_api import registered_stages
from optimize.stages import BUILTIN

TINY_GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=49152)

#: kind -> (stage parameters, model config or None for the tiny Llama)
EXAMPLES: dict[str, tuple[dict, dict | None]] = {
    "ptq_int8": ({"scheme": "8da8w"}, None),
    "rmsnorm": ({}, TINY_GPT2),
    "gqa": ({"num_key_value_heads": 1}, None),
    "rotate": ({"seed": 1}, None),
    "smoothquant": ({"alpha": 0.5}, None),
    "awq": ({"rows": 32}, None),
    "distill": ({"steps": 2, "seq_len": 32, "temperature": 2.0, "alpha": 0.1}, None),
    "qat": ({"scheme": "8da4w", "steps": 2, "seq_len": 32}, None),
    "prune": ({"method": "width", "num_attention_heads": 2, "mlp_ratio": 0.25}, None),
}


def test_every_builtin_stage_is_registered_and_has_an_example():
    specs = registered_stages()
    for kind in BUILTIN:
        assert kind in specs, f"built-in stage {kind!r} did not register"
        assert specs[kind].description, f"stage {kind!r} has no one-line description (docstring)"
        assert kind in EXAMPLES, f"add an example for stage {kind!r} to EXAMPLES"


@pytest.mark.parametrize("kind", BUILTIN)
def test_stage_runs_in_pipeline_with_report_row(kind, tiny_cfg):
    params, model_config = EXAMPLES[kind]
    if model_config is not None:
        tiny_cfg["model"]["config"] = dict(model_config)
    stage = {"kind": kind, **params}
    tiny_cfg["stages"] = [stage]

    cfg = load_config(tiny_cfg)
    # the stage config round-trips through YAML unchanged
    dumped = cfg.stages[0].model_dump(mode="json", exclude_none=True)
    again = load_config({**tiny_cfg, "stages": [yaml.safe_load(yaml.safe_dump(dumped))]})
    assert again.stages[0] == cfg.stages[0]

    report = run_pipeline(cfg, say=lambda m: None)
    assert report.ok, report.rows[-1].error or [g.message for g in report.rows[-1].gates]
    row = report.row(f"0:{kind}")
    m = row.metrics
    assert m.perplexity is not None and m.perplexity > 1
    assert m.top1_agreement is not None and 0 <= m.top1_agreement <= 1
    assert m.kl_divergence is not None and m.kl_divergence >= -1e-4
    assert m.params and m.size_mb and m.eval_tokens == 256


@pytest.mark.parametrize("kind", BUILTIN)
def test_stage_keeps_output_shape(kind, tiny_cfg, tmp_path):
    from optimize.config import load_config as _load
    from optimize.stage_api import StageContext, get_stage
    from targets.sources import load_model

    params, model_config = EXAMPLES[kind]
    if model_config is not None:
        tiny_cfg["model"]["config"] = dict(model_config)
    tiny_cfg["stages"] = [{"kind": kind, **params}]
    cfg = _load(tiny_cfg)
    loaded = load_model(cfg.model)
    model = loaded.model
    ids = torch.randint(0, 1000, (1, 24))
    with torch.no_grad():
        before = model(ids).logits.shape
    calib = [torch.randint(0, 1000, (64,)) for _ in range(2)]
    ctx = StageContext(tokenizer=loaded.tokenizer, calibration=calib, train_ids=torch.randint(0, 1000, (4096,)),
                       target=None, work_dir=tmp_path,
                       baseline_model=copy.deepcopy(model))
    out = get_stage(kind).fn(model, cfg.stages[0], ctx)
    with torch.no_grad():
        after = out(ids).logits.shape
    assert after == before
