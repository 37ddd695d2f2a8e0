"""Evaluate gates (metric goals) on one report row against the baseline row."""

from __future__ import annotations

from optimize.gates_config import GATE_METRICS, GateResult, GatesConfig, MetricGoal
from optimize.report import Metrics


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


def _check_task(task: str, goal: MetricGoal, metrics: Metrics, baseline: Metrics) -> GateResult:
    """A task goal on its headline metric in accuracy points; the message names the task, the figures,
    the items they rest on and their standard error."""
    score = (metrics.tasks or {}).get(task)
    base = (baseline.tasks or {}).get(task) if baseline is not None else None
    name = f"tasks.{task}"
    goal_d = goal.model_dump(exclude_none=True)
    if score is None or score.score is None:
        return GateResult(metric=name, goal=goal_d, value=None, baseline=base.score if base else None, ok=False,
                          message=f"{task} was not scored on this row, so its gate cannot pass")
    value, metric = score.score, score.metric
    on = f"{score.items} items" + (f" (limit of {score.split_items})" if score.items < score.split_items else "")
    err = f" ± {score.score_stderr:.1f}" if score.score_stderr is not None else ""
    if goal.threshold is not None:
        ok = value >= goal.threshold
        msg = (f"{task} {metric} {value:.1f}{err} points on {on} {'meets' if ok else 'misses'} "
               f"threshold >= {goal.threshold:g}")
        return GateResult(metric=name, goal=goal_d, value=value, baseline=base.score if base else None, ok=ok,
                          message=msg)
    if base is None or base.score is None:
        return GateResult(metric=name, goal=goal_d, value=value, baseline=None, ok=False,
                          message=f"{task}: no baseline score to compare with (score the baseline row: "
                          "checks.tasks.rows must include 'baseline')")
    worse = base.score - value
    if goal.max_degradation is not None:
        ok = worse <= goal.max_degradation
        msg = (f"{task} {metric} {value:.1f}{err} vs baseline {base.score:.1f} points on {on}: "
               f"worsened by {worse:.1f} points (allowed {goal.max_degradation:g})")
    else:
        pct = 100.0 * worse / abs(base.score) if base.score else float("inf")
        ok = pct <= goal.max_pct_degradation
        msg = (f"{task} {metric} {value:.1f}{err} vs baseline {base.score:.1f} points on {on}: "
               f"worsened by {pct:.2f}% (allowed {goal.max_pct_degradation:g}%)")
    return GateResult(metric=name, goal=goal_d, value=value, baseline=base.score, ok=ok, message=msg)


def evaluate_gates(gates: GatesConfig, metrics: Metrics, baseline: Metrics) -> list[GateResult]:
    results = []
    for metric, goal in gates.goals().items():
        results.append(_check(metric, goal, getattr(metrics, metric), getattr(baseline, metric)))
    if gates.tasks and metrics.tasks is not None:  # rows that checks.tasks does not score are not gated on tasks
        for task, goal in gates.tasks.items():
            results.append(_check_task(task, goal, metrics, baseline))
    return results
