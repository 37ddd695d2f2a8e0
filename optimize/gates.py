"""Evaluate gates (metric goals) on one report row against the baseline row."""

from __future__ import annotations

from optimize.gates_config import GATE_METRICS, GatesConfig, MetricGoal
from optimize.report import GateResult, Metrics


def _check(metric: str, goal: MetricGoal, value: float | None, base: float | None) -> GateResult:
    higher_better, unit, _ = GATE_METRICS[metric]
    if value is None:
        return GateResult(metric=metric, goal=goal.model_dump(exclude_none=True), value=None, baseline=base,
                          ok=False, message=f"{metric} was not measured, so its gate cannot pass")
    u = f" {unit}" if unit and unit != "fraction" else ""
    if goal.threshold is not None:
        ok = value >= goal.threshold if higher_better else value <= goal.threshold
        rel = ">=" if higher_better else "<="
        msg = f"{metric} {value:.4g}{u} {'meets' if ok else 'misses'} threshold {rel} {goal.threshold:g}{u}"
    else:
        if base is None:
            return GateResult(metric=metric, goal=goal.model_dump(exclude_none=True), value=value, baseline=None,
                              ok=False, message=f"{metric}: no baseline value to compare with")
        worse = (base - value) if higher_better else (value - base)
        if goal.max_degradation is not None:
            ok = worse <= goal.max_degradation
            msg = (f"{metric} {value:.4g}{u} vs baseline {base:.4g}: worsened by {worse:.4g}{u} "
                   f"(allowed {goal.max_degradation:g})")
        else:
            pct = 100.0 * worse / abs(base) if base else float("inf")
            ok = pct <= goal.max_pct_degradation
            msg = (f"{metric} {value:.4g}{u} vs baseline {base:.4g}: worsened by {pct:.2f}% "
                   f"(allowed {goal.max_pct_degradation:g}%)")
    return GateResult(metric=metric, goal=goal.model_dump(exclude_none=True), value=value, baseline=base, ok=ok, message=msg)


def evaluate_gates(gates: GatesConfig, metrics: Metrics, baseline: Metrics) -> list[GateResult]:
    results = []
    for metric, goal in gates.goals().items():
        results.append(_check(metric, goal, getattr(metrics, metric), getattr(baseline, metric)))
    return results
