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
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "size_budget_mb": budget,
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
