"""Mixed precision by budget: promote the most sensitive modules to a higher precision (int8
or fp32) while the model stays within a size budget and/or a decode-latency budget.

Candidates (module groups such as ``lm_head``, a whole block, or every ``down_proj``) are
scored by :func:`optimize.quant.sensitivity.analyze_sensitivity` on calibration text, then promoted
greedily by KL saved per extra byte until a budget is spent. Groups may overlap
(``*.down_proj`` and ``model.layers.29``): a module's bytes are counted once.

The size model counts what the exported weights take: int4 groups store 0.5 byte per
weight plus an fp32 scale and an int8 zero point per group (``0.5 + 5/group_size`` bytes
per weight), int8 per-channel ``1 + 5/in_features``, fp32 4 bytes. A tied output
projection kept fp32 costs no storage: it shares the fp32 embedding table. Other
parameters (norms, biases, the embedding table unless quantized) are counted at fp32.

The latency model is the one decode is bound by on a CPU or phone: every decoded token
reads every Linear weight once (the embedding only reads one row), so decode time scales
with the Linear weight bytes. The decode budget is a slowdown in percent against the plain
model with every Linear, ``lm_head`` included, at the stage's scheme. A tied ``lm_head`` kept
fp32 is free in storage but reads the whole fp32 table per token, which this model counts.
The pipeline's latency check then measures the real figure in the shipped runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from optimize.module_select import is_tied, matches, module_name, resolve_patterns
from optimize.quant.sensitivity import analyze_sensitivity, module_groups

MB = 1e6
Promote = Literal["fp32", "8da8w"]


def quantized_bytes(mod: nn.Linear, bits: int, group_size: int | None) -> float:
    """Bytes one Linear weight takes in the int4-group / int8-channel layout."""
    n = mod.weight.numel()
    if bits == 4:
        return n * (0.5 + 5.0 / (group_size or 32))
    return n * (1.0 + 5.0 / mod.in_features)


def _promoted_bytes(mod: nn.Linear, promote_to: Promote) -> float:
    return mod.weight.numel() * 4.0 if promote_to == "fp32" else quantized_bytes(mod, 8, None)


def _tied_head(model: nn.Module) -> str | None:
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    out = get_out()
    return module_name(model, out) if is_tied(get_in(), out) else None


def keep_cost(model: nn.Module, name: str, bits: int, group_size: int | None, promote_to: Promote = "fp32") -> float:
    """Extra stored bytes of promoting ``name`` from ``bits`` to ``promote_to`` (a tied output
    projection kept fp32 shares the embedding table, so it *saves* its quantized copy)."""
    if promote_to == "fp32" and name == _tied_head(model):
        return -quantized_bytes(model.get_submodule(name), bits, group_size)  # quantizing it would add an un-tied copy
    return decode_cost(model, name, bits, group_size, promote_to)


def decode_cost(model: nn.Module, name: str, bits: int, group_size: int | None, promote_to: Promote = "fp32") -> float:
    """Extra weight bytes read per decoded token when ``name`` is promoted to ``promote_to``."""
    mod = model.get_submodule(name)
    return _promoted_bytes(mod, promote_to) - quantized_bytes(mod, bits, group_size)


def _linear_bytes(mod: nn.Linear, name: str, quantized: set[str], bits: int, group_size: int | None,
                  int8: set[str] | frozenset) -> float:
    """One Linear weight's bytes: int8 per channel if in ``int8``, ``bits`` if in ``quantized``, else fp32."""
    if name in int8:
        return quantized_bytes(mod, 8, None)
    if name in quantized:
        return quantized_bytes(mod, bits, group_size)
    return mod.weight.numel() * 4.0


def decode_bytes(
    model: nn.Module, quantized: set[str], bits: int, group_size: int | None, int8: set[str] | frozenset = frozenset()
) -> float:
    """Linear weight bytes read per decoded token: ``quantized`` at ``bits``, ``int8`` at int8, the rest fp32."""
    return sum(_linear_bytes(mod, name, quantized, bits, group_size, int8)
               for name, mod in model.named_modules() if isinstance(mod, nn.Linear))


def model_bytes(
    model: nn.Module, quantized: set[str], bits: int, group_size: int | None, int8: set[str] | frozenset = frozenset()
) -> float:
    """Estimated weight bytes when the ``quantized`` Linears are quantized at ``bits`` (those also
    in ``int8`` at int8 per channel) and the rest stay fp32."""
    total = 0.0
    seen: set[int] = set()
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if pname == "weight" and isinstance(mod, nn.Linear) and (name in quantized or name in int8):
                total += _linear_bytes(mod, name, quantized, bits, group_size, int8)
            else:
                total += p.numel() * p.element_size()
    tied = _tied_head(model)
    if tied and (tied in quantized or tied in int8):  # the un-tied quantized copy comes on top of the fp32 table
        total += _linear_bytes(model.get_submodule(tied), tied, quantized, bits, group_size, int8)
    return total


@dataclass
class BudgetPlan:
    kept: list[str]  # promoted modules (to ``promote_to``)
    kept_groups: list[str]
    size_mb: float
    all_quantized_mb: float
    budget_mb: float | None
    skipped_groups: list[str] = field(default_factory=list)
    promote_to: Promote = "fp32"
    decode_budget_pct: float | None = None
    #: estimated decode slowdown (percent) against every Linear at the stage's scheme
    decode_slowdown_pct: float = 0.0

    def as_details(self) -> dict:
        return {
            "promote_to": self.promote_to,
            "size_budget_mb": self.budget_mb,
            "decode_budget_pct": self.decode_budget_pct,
            "estimated_size_mb": round(self.size_mb, 2),
            "all_quantized_size_mb": round(self.all_quantized_mb, 2),
            "estimated_decode_slowdown_pct": round(self.decode_slowdown_pct, 2),
            "kept_groups": self.kept_groups,
            "kept_for_budget": self.kept,
            "over_budget_groups": self.skipped_groups,
        }


def plan_budget(
    model: nn.Module,
    scored: list[tuple[str, list[str], float]],
    selected: list[str],
    budget_mb: float | None,
    bits: int,
    group_size: int | None,
    *,
    promote_to: Promote = "fp32",
    decode_budget_pct: float | None = None,
    int8_fixed: set[str] | frozenset = frozenset(),
) -> BudgetPlan:
    """Choose which scored groups (``(label, module names, KL)``) of the ``selected`` Linears to
    promote to ``promote_to`` so the estimated size stays within ``budget_mb`` and the estimated
    decode slowdown within ``decode_budget_pct`` (either may be None, not both).

    ``int8_fixed`` are selected modules the user already put at int8. Greedy by KL per extra
    byte (free groups first); raises if even the plan's starting point breaks a budget.
    """
    if budget_mb is None and decode_budget_pct is None:
        raise ValueError("give a size budget (MB), a decode budget (percent), or both")
    if budget_mb is not None and budget_mb <= 0:
        raise ValueError(f"size budget {budget_mb} MB must be positive")
    if decode_budget_pct is not None and decode_budget_pct < 0:
        raise ValueError(f"decode budget {decode_budget_pct}% must be >= 0")
    sel = set(selected)
    fixed8 = set(int8_fixed) & sel
    base = model_bytes(model, sel, bits, group_size, fixed8)
    if budget_mb is not None and base > budget_mb * MB:
        raise ValueError(
            f"size budget {budget_mb} MB is below the fully quantized estimate {base / MB:.1f} MB; "
            "raise size_budget_mb or quantize more (e.g. the embedding)"
        )
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    plain = decode_bytes(model, linears, bits, group_size)
    dec = decode_bytes(model, sel, bits, group_size, fixed8)
    dec_limit = plain * (1.0 + decode_budget_pct / 100.0) if decode_budget_pct is not None else float("inf")
    if dec > dec_limit:
        raise ValueError(
            f"decode budget {decode_budget_pct}%: the layers already outside the {bits}-bit scheme "
            f"(keep_high_precision, int8_modules) make decode an estimated {100 * (dec / plain - 1):.1f}% slower than "
            f"every Linear at {bits} bits; raise max_decode_slowdown_pct or keep fewer layers high-precision"
        )
    kept: set[str] = set()
    kept_groups, skipped = [], []
    size = base

    def movable(names: list[str]) -> list[str]:
        return [n for n in names if n in sel and n not in kept and not (promote_to == "8da8w" and n in fixed8)]

    def extra(names: list[str]) -> float:
        return sum(keep_cost(model, n, bits, group_size, promote_to) for n in movable(names))

    def extra_decode(names: list[str]) -> float:
        return sum(decode_cost(model, n, bits, group_size, promote_to) for n in movable(names))

    def price(names: list[str]) -> float:  # the scarcer budget decides what a byte is worth
        return max(extra(names) if budget_mb is not None else 0.0, extra_decode(names) if decode_budget_pct is not None else 0.0)

    order = sorted(scored, key=lambda g: -g[2] / max(price(g[1]), 1.0))
    for label, names, kl in order:
        if kl <= 0 or not movable(names):
            continue
        cost, dcost = extra(names), extra_decode(names)
        if (budget_mb is None or size + cost <= budget_mb * MB) and dec + dcost <= dec_limit:
            size += cost
            dec += dcost
            kept.update(movable(names))
            kept_groups.append(label)
        else:
            skipped.append(label)
    return BudgetPlan(
        kept=[n for n in selected if n in kept], kept_groups=kept_groups, size_mb=size / MB,
        all_quantized_mb=base / MB, budget_mb=budget_mb, skipped_groups=skipped, promote_to=promote_to,
        decode_budget_pct=decode_budget_pct, decode_slowdown_pct=100.0 * (dec / plain - 1.0),
    )


def budget_keep(
    model: nn.Module,
    selected: list[str],
    windows: list,
    scheme: str,
    group_size: int | None,
    budget_mb: float | None,
    candidates: list[str] | None = None,
    algorithm: str = "rtn",
    *,
    promote_to: Promote = "fp32",
    decode_budget_pct: float | None = None,
    int8_fixed: set[str] | frozenset = frozenset(),
) -> tuple[BudgetPlan, list[dict]]:
    """Score candidate groups by fake-quant sensitivity on ``windows`` and plan under the budgets.

    ``candidates`` are module patterns (each one group, e.g. ``lm_head``, ``model.layers.0``,
    ``*.down_proj``); None takes every block, every projection type and the output projection.
    A group's score is its KL when quantized alone at ``scheme``: what promoting it can win back
    at most. Returns the plan and the scored groups (for the report).
    """
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
    plan = plan_budget(model, scored, selected, budget_mb, bits, group_size, promote_to=promote_to,
                       decode_budget_pct=decode_budget_pct, int8_fixed=int8_fixed)
    return plan, [{"group": e.name, "kl": round(e.kl, 5), "delta_ppl_pct": round(e.delta_ppl_pct, 2)} for e in report.entries]
