"""Mixed precision by budget: keep the most sensitive modules fp32 while the model fits a size.

Candidates (module groups such as ``lm_head``, a whole block, or every ``down_proj``) are
scored by :func:`optimize.sensitivity.analyze_sensitivity` on calibration text, then kept
greedily by KL saved per extra byte until the size budget is spent. Groups may overlap
(``*.down_proj`` and ``model.layers.29``): a module's bytes are counted once.

The size model counts what the exported weights take: int4 groups store 0.5 byte per
weight plus an fp32 scale and an int8 zero point per group (``0.5 + 5/group_size`` bytes
per weight), int8 per-channel ``1 + 5/in_features``, fp32 4 bytes. A tied output
projection kept fp32 costs nothing extra: it shares the fp32 embedding table. Other
parameters (norms, biases, the embedding table unless quantized) are counted at fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

MB = 1e6


def quantized_bytes(mod: nn.Linear, bits: int, group_size: int | None) -> float:
    """Bytes one Linear weight takes in the int4-group / int8-channel layout."""
    n = mod.weight.numel()
    if bits == 4:
        return n * (0.5 + 5.0 / (group_size or 32))
    return n * (1.0 + 5.0 / mod.in_features)


def _tied_head(model: nn.Module) -> str | None:
    from optimize.stages._select import is_tied, module_name

    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    out = get_out()
    return module_name(model, out) if is_tied(get_in(), out) else None


def keep_cost(model: nn.Module, name: str, bits: int, group_size: int | None) -> float:
    """Extra bytes of keeping ``name`` fp32 instead of quantized (0 for a tied output projection)."""
    mod = model.get_submodule(name)
    if name == _tied_head(model):
        return -quantized_bytes(mod, bits, group_size)  # quantizing it would add an un-tied copy
    return mod.weight.numel() * 4.0 - quantized_bytes(mod, bits, group_size)


def model_bytes(model: nn.Module, quantized: set[str], bits: int, group_size: int | None) -> float:
    """Estimated weight bytes when the ``quantized`` Linears are quantized and the rest fp32."""
    total = 0.0
    seen: set[int] = set()
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if pname == "weight" and name in quantized and isinstance(mod, nn.Linear):
                total += quantized_bytes(mod, bits, group_size)
            else:
                total += p.numel() * p.element_size()
    tied = _tied_head(model)
    if tied and tied in quantized:  # the un-tied quantized copy comes on top of the fp32 table
        total += quantized_bytes(model.get_submodule(tied), bits, group_size)
    return total


@dataclass
class BudgetPlan:
    kept: list[str]
    kept_groups: list[str]
    size_mb: float
    all_quantized_mb: float
    budget_mb: float
    skipped_groups: list[str] = field(default_factory=list)

    def as_details(self) -> dict:
        return {
            "size_budget_mb": self.budget_mb,
            "estimated_size_mb": round(self.size_mb, 2),
            "all_quantized_size_mb": round(self.all_quantized_mb, 2),
            "kept_groups": self.kept_groups,
            "kept_for_budget": self.kept,
            "over_budget_groups": self.skipped_groups,
        }


def plan_budget(
    model: nn.Module,
    scored: list[tuple[str, list[str], float]],
    selected: list[str],
    budget_mb: float,
    bits: int,
    group_size: int | None,
) -> BudgetPlan:
    """Choose which scored groups (``(label, module names, KL)``) of the ``selected`` Linears to
    keep fp32 so the estimated size stays within ``budget_mb``.

    Greedy by KL per extra byte (free groups first); raises if even quantizing everything
    selected exceeds the budget.
    """
    if budget_mb <= 0:
        raise ValueError(f"size budget {budget_mb} MB must be positive")
    sel = set(selected)
    base = model_bytes(model, sel, bits, group_size)
    if base > budget_mb * MB:
        raise ValueError(
            f"size budget {budget_mb} MB is below the fully quantized estimate {base / MB:.1f} MB; "
            "raise size_budget_mb or quantize more (e.g. the embedding)"
        )
    kept: set[str] = set()
    kept_groups, skipped = [], []
    size = base

    def extra(names: list[str]) -> float:
        return sum(keep_cost(model, n, bits, group_size) for n in names if n in sel and n not in kept)

    order = sorted(scored, key=lambda g: -g[2] / max(extra(g[1]), 1.0))
    for label, names, kl in order:
        if kl <= 0:
            continue
        cost = extra(names)
        if not any(n in sel and n not in kept for n in names):
            continue
        if size + cost <= budget_mb * MB:
            size += cost
            kept.update(n for n in names if n in sel)
            kept_groups.append(label)
        else:
            skipped.append(label)
    return BudgetPlan(
        kept=[n for n in selected if n in kept], kept_groups=kept_groups, size_mb=size / MB,
        all_quantized_mb=base / MB, budget_mb=budget_mb, skipped_groups=skipped,
    )


def budget_keep(
    model: nn.Module,
    selected: list[str],
    windows: list,
    scheme: str,
    group_size: int | None,
    budget_mb: float,
    candidates: list[str] | None = None,
    algorithm: str = "rtn",
) -> tuple[BudgetPlan, list[dict]]:
    """Score candidate groups by fake-quant sensitivity on ``windows`` and plan under the budget.

    ``candidates`` are module patterns (each one group, e.g. ``lm_head``, ``model.layers.0``,
    ``*.down_proj``); None takes every block, every projection type and the output projection.
    Returns the plan and the scored groups (for the report).
    """
    from optimize.sensitivity import analyze_sensitivity, module_groups
    from optimize.stages._select import matches, resolve_patterns

    sel = set(selected)
    if candidates is None:
        groups = [(label, names) for label, _, names in module_groups(model, ("blocks", "projections", "lm_head"))]
    else:
        groups = []
        for pat in candidates:
            pats = resolve_patterns(model, [pat])
            groups.append((pat, [n for n in selected if matches(n, pats)]))
        empty = [label for label, names in groups if not names]
        if empty:
            raise ValueError(f"budget candidate(s) {empty} match none of the layers being quantized")
    groups = [(label, [n for n in names if n in sel]) for label, names in groups]
    groups = [(label, names) for label, names in groups if names]
    bits = 4 if scheme in ("8da4w", "w4") else 8
    report = analyze_sensitivity(model, windows, scheme, group_size=group_size or 32, algorithm=algorithm, custom=groups)
    scored = [(e.name, e.modules, e.kl) for e in report.entries]
    plan = plan_budget(model, scored, selected, budget_mb, bits, group_size)
    return plan, [{"group": e.name, "kl": round(e.kl, 5), "delta_ppl_pct": round(e.delta_ppl_pct, 2)} for e in report.entries]
