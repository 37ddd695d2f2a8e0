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


def test_decode_budget_limits_promotion_to_int8(tiny_llama):
    """A decode budget of x% admits only groups whose extra bytes read per token fit in x% of the
    plain model (every Linear, lm_head included, at int4)."""
    from optimize.quant.mixed import decode_bytes, decode_cost

    linears = set(_linears(tiny_llama))
    sel = [n for n in _linears(tiny_llama)]
    plain = decode_bytes(tiny_llama, linears, 4, 32)
    block0 = [n for n in sel if n.startswith("model.layers.0.")]
    block1 = [n for n in sel if n.startswith("model.layers.1.")]
    per_block = sum(decode_cost(tiny_llama, n, 4, 32, "8da8w") for n in block0)
    pct = 100 * 1.5 * per_block / plain  # one block fits, two do not
    scored = [("model.layers.0", block0, 0.2), ("model.layers.1", block1, 0.5), ("lm_head", ["lm_head"], 0.01)]
    plan = plan_budget(tiny_llama, scored, sel, None, 4, 32, promote_to="8da8w", decode_budget_pct=pct)
    assert "model.layers.1" in plan.kept_groups and "model.layers.0" in plan.skipped_groups
    assert plan.decode_slowdown_pct <= pct + 1e-9
    int8 = set(plan.kept)
    assert abs(100 * (decode_bytes(tiny_llama, set(sel), 4, 32, int8) / plain - 1) - plan.decode_slowdown_pct) < 1e-9
    # promotion to int8 costs storage too: both budgets hold when both are given
    size_cap = model_bytes(tiny_llama, set(sel), 4, 32) / MB + 1e-6
    both = plan_budget(tiny_llama, scored, sel, size_cap, 4, 32, promote_to="8da8w", decode_budget_pct=pct)
    assert both.kept == [] and both.size_mb <= size_cap


def test_decode_budget_counts_a_tied_fp32_head(tiny_llama):
    """Keeping a tied lm_head fp32 is free in storage but reads the fp32 table every token."""
    sel = [n for n in _linears(tiny_llama) if n != "lm_head"]  # lm_head kept fp32 by the user
    with pytest.raises(ValueError, match=r"decode budget 10.0%.*slower"):
        plan_budget(tiny_llama, [], sel, None, 4, 32, decode_budget_pct=10.0)
    with pytest.raises(ValueError, match="give a size budget"):
        plan_budget(tiny_llama, [], sel, None, 4, 32)
    with pytest.raises(ValueError, match=">= 0"):
        plan_budget(tiny_llama, [], sel, None, 4, 32, decode_budget_pct=-1.0)
