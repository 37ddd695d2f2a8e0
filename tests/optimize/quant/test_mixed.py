"""Mixed precision under a size budget: the plan never exceeds it and prefers sensitive groups."""

from __future__ import annotations

import pytest
from torch import nn

from optimize.quant.mixed import MB, keep_cost, model_bytes, plan_budget


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_plan_respects_budget_and_prefers_sensitive(tiny_llama):
    sel = [n for n in _linears(tiny_llama) if n != "lm_head"]
    base = model_bytes(tiny_llama, set(sel), 4, 32) / MB
    block0 = [n for n in sel if n.startswith("model.layers.0.")]
    block1 = [n for n in sel if n.startswith("model.layers.1.")]
    one_block = sum(keep_cost(tiny_llama, n, 4, 32) for n in block0) / MB
    budget = base + 1.5 * one_block  # room for one block, not two
    scored = [("model.layers.0", block0, 0.01), ("model.layers.1", block1, 0.5)]
    plan = plan_budget(tiny_llama, scored, sel, budget, 4, 32)
    assert plan.kept_groups == ["model.layers.1"] and plan.skipped_groups == ["model.layers.0"]
    assert plan.size_mb <= budget
    assert abs(model_bytes(tiny_llama, set(sel) - set(plan.kept), 4, 32) / MB - plan.size_mb) < 1e-6
    roomy = plan_budget(tiny_llama, scored, sel, base + 3 * one_block, 4, 32)
    assert set(roomy.kept) == set(block0 + block1)


def test_tied_head_is_free_to_keep(tiny_llama):
    assert keep_cost(tiny_llama, "lm_head", 4, 32) < 0  # quantizing it would add an un-tied copy
    sel = _linears(tiny_llama)
    base = model_bytes(tiny_llama, set(sel), 4, 32) / MB
    plan = plan_budget(tiny_llama, [("lm_head", ["lm_head"], 0.1)], sel, base, 4, 32)
    assert plan.kept == ["lm_head"] and plan.size_mb < base


def test_budget_too_small_says_the_minimum(tiny_llama):
    sel = _linears(tiny_llama)
    with pytest.raises(ValueError, match=r"below the fully quantized estimate [\d.]+ MB"):
        plan_budget(tiny_llama, [], sel, 0.5, 4, 32)
    with pytest.raises(ValueError, match="must be positive"):
        plan_budget(tiny_llama, [], sel, 0, 4, 32)


def test_budget_keep_picks_the_sensitive_block(tiny_llama):
    import torch

    from optimize.quant.mixed import budget_keep

    with torch.no_grad():  # break block 1's down_proj for int4 (see test_sensitivity)
        w = tiny_llama.model.layers[1].mlp.down_proj.weight
        w.copy_(torch.sign(torch.randn_like(w)))
        w[:, ::32] *= 15.0
    sel = [n for n in _linears(tiny_llama) if n != "lm_head"]
    base = model_bytes(tiny_llama, set(sel), 4, 32) / MB
    block = sum(keep_cost(tiny_llama, n, 4, 32) for n in sel if n.startswith("model.layers.1.")) / MB
    wins = [torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(2))]
    plan, scored = budget_keep(tiny_llama, sel, wins, "8da4w", 32, base + 1.2 * block,
                               candidates=["model.layers.0", "model.layers.1"])
    assert plan.kept_groups == ["model.layers.1"] and plan.size_mb <= base + 1.2 * block
    assert scored[0]["group"] == "model.layers.1"
    with pytest.raises(ValueError, match=r"candidate\(s\) \['model.layers.7'\] match none"):
        budget_keep(tiny_llama, sel, wins, "8da4w", 32, base * 2, candidates=["model.layers.7"])
