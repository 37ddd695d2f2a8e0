"""ptq_int8 with size_budget_mb: the quantized model really has the mix, within the budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optimize import load_config
from optimize.errors import ConfigError
from optimize.quant.mixed import MB, keep_cost, model_bytes
from optimize.stage_api import StageContext, get_stage


def _ctx(tmp_path):
    wins = [torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(2))]
    return StageContext(tokenizer=None, calibration=wins, train_ids=torch.zeros(0, dtype=torch.long),
                        target=None, work_dir=tmp_path)


def test_budget_keeps_the_broken_block_fp32(tiny_llama, tiny_cfg, tmp_path):
    from torchao.utils import TorchAOBaseTensor

    with torch.no_grad():
        w = tiny_llama.model.layers[1].mlp.down_proj.weight
        w.copy_(torch.sign(torch.randn_like(w)))
        w[:, ::32] *= 15.0
    sel = [n for n, m in tiny_llama.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    base = model_bytes(tiny_llama, set(sel), 4, 32) / MB
    block = sum(keep_cost(tiny_llama, n, 4, 32) for n in sel if n.startswith("model.layers.1.")) / MB
    budget = round(base + 1.2 * block, 4)
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "size_budget_mb": budget, "budget_promote_to": "fp32",
                           "budget_candidates": ["model.layers.0", "model.layers.1"], "budget_windows": 1}]
    cfg = load_config(tiny_cfg).stages[0]
    ctx = _ctx(tmp_path)
    model = get_stage("ptq_int8").fn(tiny_llama, cfg, ctx)
    mix = ctx.details["mixed_precision"]
    assert mix["kept_groups"] == ["model.layers.1"] and mix["estimated_size_mb"] <= budget
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name != "lm_head":
            assert isinstance(mod.weight, TorchAOBaseTensor) == (not name.startswith("model.layers.1.")), name
    assert set(ctx.details["kept_modules"]) >= set(mix["kept_for_budget"])


@pytest.mark.parametrize(
    "params,message",
    [
        ({"budget_candidates": ["model.layers.0"]}, "budget_candidates applies only with size_budget_mb"),
        ({"size_budget_mb": 0}, "greater than 0"),
        ({"size_budget_mb": 10, "budget_windows": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_budget_options(tiny_cfg, params, message):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", **params}]
    with pytest.raises(ConfigError, match=message):
        load_config(tiny_cfg)


def test_budget_below_minimum_says_so(tiny_llama, tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "size_budget_mb": 0.01}]
    with pytest.raises(ValueError, match="below the fully quantized estimate"):
        get_stage("ptq_int8").fn(tiny_llama, load_config(tiny_cfg).stages[0], _ctx(tmp_path))


def test_decode_budget_promotes_the_broken_block_to_int8(tiny_llama, tiny_cfg, tmp_path):
    """max_decode_slowdown_pct with the default promotion (8da8w for 8da4w): the broken block is int8,
    the rest int4, and the report's estimate stays within the budget."""
    from optimize.quant.mixed import decode_bytes, decode_cost

    with torch.no_grad():
        w = tiny_llama.model.layers[1].mlp.down_proj.weight
        w.copy_(torch.sign(torch.randn_like(w)))
        w[:, ::32] *= 15.0
    lin = [n for n, m in tiny_llama.named_modules() if isinstance(m, nn.Linear)]
    plain = decode_bytes(tiny_llama, set(lin), 4, 32)
    block = sum(decode_cost(tiny_llama, n, 4, 32, "8da8w") for n in lin if n.startswith("model.layers.1."))
    pct = round(100 * 1.2 * block / plain, 3)
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [],
                           "max_decode_slowdown_pct": pct, "budget_windows": 1,
                           "budget_candidates": ["model.layers.0", "model.layers.1"]}]
    ctx = _ctx(tmp_path)
    model = get_stage("ptq_int8").fn(tiny_llama, load_config(tiny_cfg).stages[0], ctx)
    mix = ctx.details["mixed_precision"]
    assert mix["promote_to"] == "8da8w" and mix["kept_groups"] == ["model.layers.1"]
    assert mix["estimated_decode_slowdown_pct"] <= pct
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            want = torch.int8 if name.startswith("model.layers.1.") else torch.int4
            assert mod.weight.target_dtype == want, name
    assert ctx.details["precision_mix"] == {"fp32": 0, "8da8w": 7, "8da4w": 8}


@pytest.mark.parametrize(
    "params,message",
    [
        ({"budget_promote_to": "fp32"}, "budget_promote_to applies only with size_budget_mb or max_decode_slowdown_pct"),
        ({"budget_windows": 4}, "budget_windows applies only"),
        ({"max_decode_slowdown_pct": -5}, "greater than or equal to 0"),
        ({"scheme": "8da8w", "max_decode_slowdown_pct": 5, "budget_promote_to": "8da8w"}, "needs scheme 8da4w"),
        ({"scheme": "8da8w", "int8_modules": ["lm_head"]}, "int8_modules applies only to scheme 8da4w"),
        ({"int8_modules": [""]}, "non-empty strings"),
        ({"budget_promote_to": "int2", "size_budget_mb": 5}, r"stages\.0\.budget_promote_to"),
    ],
)
def test_bad_mixed_precision_options(tiny_cfg, params, message):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", **params}]
    with pytest.raises(ConfigError, match=message):
        load_config(tiny_cfg)


def test_int8_modules_that_clash_or_match_nothing_say_so(tiny_llama, tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "int8_modules": ["lm_head"]}]
    with pytest.raises(ValueError, match="both int8_modules and keep_high_precision"):
        get_stage("ptq_int8").fn(tiny_llama, load_config(tiny_cfg).stages[0], _ctx(tmp_path))
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "int8_modules": ["model.layerz.*"]}]
    with pytest.raises(ValueError, match=r"\['model.layerz.\*'\] match no module"):
        get_stage("ptq_int8").fn(tiny_llama, load_config(tiny_cfg).stages[0], _ctx(tmp_path))
