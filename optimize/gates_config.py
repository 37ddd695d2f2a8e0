"""Gates: Olive-style metric goals that stop (or warn about) a stage that costs too much.

Each metric takes at most one goal form:
- ``threshold``: an absolute bound (a floor for higher-is-better metrics, a ceiling otherwise);
- ``max_degradation``: the largest allowed change against the baseline, in the metric's units;
- ``max_pct_degradation``: the same as a percentage of the baseline value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from targets.config_base import Strict

#: metric name -> (higher is better, unit, comparable to the baseline)
GATE_METRICS: dict[str, tuple[bool, str, bool]] = {
    "perplexity": (False, "", True),
    "top1_agreement": (True, "fraction", False),
    "kl_divergence": (False, "nats/token", False),
    "size_mb": (False, "MiB", True),
    "prefill_ms": (False, "ms", True),
    "decode_tok_s": (True, "tok/s", True),
}


class MetricGoal(Strict):
    threshold: float | None = Field(None, description="absolute bound: floor if higher is better, else ceiling")
    max_degradation: float | None = Field(None, ge=0, description="largest allowed worsening vs baseline")
    max_pct_degradation: float | None = Field(None, ge=0, description="largest allowed worsening vs baseline, %")

    @model_validator(mode="after")
    def _one_goal(self):
        set_ = [k for k in ("threshold", "max_degradation", "max_pct_degradation") if getattr(self, k) is not None]
        if len(set_) != 1:
            raise ValueError(
                "a metric goal takes exactly one of threshold, max_degradation, max_pct_degradation"
                + (f" (got {', '.join(set_)})" if set_ else " (got none)")
            )
        return self


class TaskGoal(MetricGoal):
    """A goal on one lm-eval task or group, in the metric's own units: accuracy-type metrics in points
    (0-100), perplexities as they are, bits per byte as they are; ``max_pct_degradation`` is percent of
    the baseline's value. The direction (floor or ceiling) is the metric's own (lm-eval's
    ``higher_is_better``)."""

    metric: str | None = Field(None, description="the metric to gate (lm-eval's name, e.g. acc, "
                               "word_perplexity, bits_per_byte, exact_match,strict-match); null: the task's "
                               "headline (acc_norm, else acc, else exact_match, else its first metric)")


class GatesConfig(Strict):
    """Metric goals plus what to do when one fails."""

    on_fail: Literal["stop", "warn"] = Field("stop", description="stop the run, or only warn")
    perplexity: MetricGoal | None = None
    top1_agreement: MetricGoal | None = None
    kl_divergence: MetricGoal | None = None
    size_mb: MetricGoal | None = None
    prefill_ms: MetricGoal | None = None
    decode_tok_s: MetricGoal | None = None
    tasks: dict[str, TaskGoal] | None = Field(
        None, description="per lm-eval task or group that checks.tasks scores (a group's member tasks too), "
        "in the metric's own units: e.g. {hellaswag: {max_degradation: 2.0}} (points), "
        "{wikitext: {metric: word_perplexity, max_pct_degradation: 5}}; a row whose tasks were not scored "
        "is not gated on them",
    )

    @model_validator(mode="after")
    def _relative_needs_baseline(self):
        for name, (_, _, comparable) in GATE_METRICS.items():
            goal = getattr(self, name)
            if goal is not None and not comparable and goal.threshold is None:
                raise ValueError(
                    f"{name} is already measured against the baseline; give it a threshold, "
                    "not max_degradation/max_pct_degradation"
                )
        return self

    def goals(self) -> dict[str, MetricGoal]:
        return {n: getattr(self, n) for n in GATE_METRICS if getattr(self, n) is not None}

    def merged_with(self, override: "GatesConfig | None") -> "GatesConfig":
        """Per-stage override: metrics it names replace ours; its on_fail wins if it set one."""
        if override is None:
            return self
        data = self.model_dump()
        for name, goal in override.goals().items():
            data[name] = goal.model_dump()
        if override.tasks:
            data["tasks"] = {**(data.get("tasks") or {}), **{k: g.model_dump() for k, g in override.tasks.items()}}
        if "on_fail" in override.model_fields_set:
            data["on_fail"] = override.on_fail
        return GatesConfig.model_validate(data)


class GateResult(BaseModel):
    """One gate checked on one report row: the metric, its goal, the row's value and the baseline's,
    and whether it held (a device's gates too: :func:`optimize.footprint.predict.device_gates`)."""

    metric: str
    goal: dict[str, Any]
    value: float | None
    baseline: float | None
    ok: bool
    message: str

