"""Evaluate gates (metric goals) on one report row against the baseline row."""

from __future__ import annotations

from optimize.gates_config import GATE_METRICS, GateResult, GatesConfig, MetricGoal, TaskGoal
from optimize.report import Metrics
from optimize.tasks.scores import format_value, unit_of


def _holds(goal: MetricGoal, value: float, base: float | None,
           higher_better: bool) -> tuple[bool, float | None, float | None]:
    """Whether ``value`` meets ``goal``, and how much it worsened from ``base`` (in the metric's
    units, and in percent of ``base``; None where the goal does not compare). A relative goal needs
    ``base``: the callers say why it is missing before asking."""
    if goal.threshold is not None:
        return (value >= goal.threshold if higher_better else value <= goal.threshold), None, None
    worse = (base - value) if higher_better else (value - base)
    if goal.max_degradation is not None:
        return worse <= goal.max_degradation, worse, None
    pct = 100.0 * worse / abs(base) if base else float("inf")
    return pct <= goal.max_pct_degradation, worse, pct


def _check(metric: str, goal: MetricGoal, value: float | None, base: float | None) -> GateResult:
    higher_better, unit, _ = GATE_METRICS[metric]
    if value is None:
        return GateResult(metric=metric, goal=goal.model_dump(exclude_none=True), value=None, baseline=base,
                          ok=False, message=f"{metric} was not measured, so its gate cannot pass")
    u = f" {unit}" if unit and unit != "fraction" else ""
    if goal.threshold is None and base is None:
        return GateResult(metric=metric, goal=goal.model_dump(exclude_none=True), value=value, baseline=None,
                          ok=False, message=f"{metric}: no baseline value to compare with")
    ok, worse, pct = _holds(goal, value, base, higher_better)
    if goal.threshold is not None:
        rel = ">=" if higher_better else "<="
        msg = f"{metric} {value:.4g}{u} {'meets' if ok else 'misses'} threshold {rel} {goal.threshold:g}{u}"
    elif goal.max_degradation is not None:
        msg = (f"{metric} {value:.4g}{u} vs baseline {base:.4g}: worsened by {worse:.4g}{u} "
               f"(allowed {goal.max_degradation:g})")
    else:
        msg = (f"{metric} {value:.4g}{u} vs baseline {base:.4g}: worsened by {pct:.2f}% "
               f"(allowed {goal.max_pct_degradation:g}%)")
    return GateResult(metric=metric, goal=goal.model_dump(exclude_none=True), value=value, baseline=base, ok=ok, message=msg)


def _check_task(task: str, goal: TaskGoal, metrics: Metrics, baseline: Metrics) -> GateResult:
    """A task goal on one of its metrics (the headline unless the goal names one) in the metric's own
    units; the message names the task, the figures, the items they rest on and their standard error."""
    score = (metrics.tasks or {}).get(task)
    base = (baseline.tasks or {}).get(task) if baseline is not None else None
    name = f"tasks.{task}" + (f".{goal.metric}" if goal.metric else "")
    goal_d = goal.model_dump(exclude_none=True)
    key = score.find(goal.metric) if score is not None else None
    base_key = base.find(goal.metric) if base is not None else None
    base_v = base.value(base_key) if base_key else None
    if score is None or key is None or score.value(key) is None:
        what = f"{task} {goal.metric}" if goal.metric and score is not None else task
        return GateResult(metric=name, goal=goal_d, value=None, baseline=base_v, ok=False,
                          message=f"{what} was not scored on this row, so its gate cannot pass"
                          + (f" (it has: {', '.join(score.metrics)})" if score is not None and score.metrics else ""))
    value, unit, higher = score.value(key), unit_of(key), score.better_high(key)
    u = " points" if unit == "points" else (f" {unit}" if unit else "")
    on = f"{score.items} items" + (f" (limit of {score.split_items})" if score.items < score.split_items else "")
    err = score.value_stderr(key)
    err_s = f" ± {format_value(err, unit)}" if err is not None else ""
    if goal.threshold is None and base_v is None:
        return GateResult(metric=name, goal=goal_d, value=value, baseline=None, ok=False,
                          message=f"{task}: no baseline score to compare with (score the baseline row: "
                          "checks.tasks.rows must include 'baseline')")
    ok, worse, pct = _holds(goal, value, base_v, higher)
    if goal.threshold is not None:
        msg = (f"{task} {key} {format_value(value, unit)}{err_s}{u} on {on} {'meets' if ok else 'misses'} "
               f"threshold {'>=' if higher else '<='} {goal.threshold:g}")
        return GateResult(metric=name, goal=goal_d, value=value, baseline=base_v, ok=ok, message=msg)
    head = f"{task} {key} {format_value(value, unit)}{err_s} vs baseline {format_value(base_v, unit)}{u} on {on}"
    if goal.max_degradation is not None:
        msg = f"{head}: worsened by {format_value(worse, unit)}{u} (allowed {goal.max_degradation:g})"
    else:
        msg = f"{head}: worsened by {pct:.2f}% (allowed {goal.max_pct_degradation:g}%)"
    return GateResult(metric=name, goal=goal_d, value=value, baseline=base_v, ok=ok, message=msg)


def evaluate_gates(gates: GatesConfig, metrics: Metrics, baseline: Metrics) -> list[GateResult]:
    results = []
    for metric, goal in gates.goals().items():
        results.append(_check(metric, goal, getattr(metrics, metric), getattr(baseline, metric)))
    if gates.tasks and metrics.tasks is not None:  # rows that checks.tasks does not score are not gated on tasks
        for task, goal in gates.tasks.items():
            results.append(_check_task(task, goal, metrics, baseline))
    return results
