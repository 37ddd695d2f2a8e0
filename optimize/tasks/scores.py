"""One task's (or group's) scores on one report row, in the task's own units (pydantic only: the
report imports it).

Metric keys are lm-eval's: ``acc``, ``acc_norm``, ``word_perplexity``, ``bits_per_byte``, ... with
the filter appended as lm-eval prints it (``exact_match,strict-match``) when it is not ``none``.
Accuracy-type metrics (fractions in lm-eval's output) are shown and gated in **points** (0-100);
every other metric in its own unit (a perplexity as is, bits per byte as is).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

#: metrics lm-eval reports as a fraction of items; shown and gated in points (x100)
FRACTION_METRICS = frozenset({"acc", "acc_norm", "acc_mutual_info", "exact_match", "f1", "mcc", "em",
                              "contains", "acc_bytes"})
#: preferred headline metrics, in order; otherwise the task's first metric
HEADLINE_ORDER = ("acc_norm", "acc", "exact_match")


def base_metric(key: str) -> str:
    """``exact_match,strict-match`` -> ``exact_match``."""
    return key.split(",", 1)[0]


def unit_of(key: str) -> str:
    base = base_metric(key)
    if base in FRACTION_METRICS:
        return "points"
    if base == "bits_per_byte":
        return "bits/byte"
    return ""


def format_value(v: float, unit: str) -> str:
    """A metric in its display units as the report, the gates and the bench print it."""
    return f"{v:.1f}" if unit == "points" else f"{v:.4g}"


def pick_headline(keys: list[str]) -> str | None:
    for want in HEADLINE_ORDER:
        for k in keys:
            if base_metric(k) == want:
                return k
    return keys[0] if keys else None


class TaskScore(BaseModel):
    """One task's or group's result on one row."""

    task: str
    kind: Literal["task", "group"] = "task"
    output_type: str | None = Field(None, description="lm-eval's output type (a group: None)")
    metrics: dict[str, float] = Field(default_factory=dict, description="lm-eval's values (fractions for accuracies)")
    stderr: dict[str, float] = Field(default_factory=dict, description="standard errors, same keys and units")
    higher_is_better: dict[str, bool] = Field(default_factory=dict)
    headline: str | None = Field(None, description="the metric gated and shown by default")
    items: int = Field(0, description="items scored (the limit, or the whole split; a group: over its tasks)")
    split_items: int = Field(0, description="items in the split (a group: over its tasks)")
    num_fewshot: int = 0
    subtasks: list[str] = Field(default_factory=list, description="a group's direct members")
    parent: str | None = Field(None, description="the group this score belongs to, when scored as part of one")

    @property
    def metric(self) -> str:
        """The headline metric's key."""
        return self.headline or next(iter(self.metrics), "")

    @staticmethod
    def _shown(key: str, v: float | None) -> float | None:
        return None if v is None else (100.0 * v if unit_of(key) == "points" else v)

    def value(self, key: str | None = None) -> float | None:
        """A metric in display units (accuracies in points)."""
        key = key or self.metric
        return self._shown(key, self.metrics.get(key))

    def value_stderr(self, key: str | None = None) -> float | None:
        """Its standard error, in the same units."""
        key = key or self.metric
        return self._shown(key, self.stderr.get(key))

    def better_high(self, key: str | None = None) -> bool:
        key = key or self.metric
        return self.higher_is_better.get(key, unit_of(key) == "points")

    def find(self, name: str | None) -> str | None:
        """The metric key a goal names (``acc``, or ``exact_match,strict-match``; a bare name takes
        its first filter); None: the headline."""
        if name is None:
            return self.metric
        if name in self.metrics:
            return name
        return next((k for k in self.metrics if base_metric(k) == name), None)

    @property
    def score(self) -> float | None:
        """The headline metric in display units."""
        return self.value()

    @property
    def score_stderr(self) -> float | None:
        return self.value_stderr()


__all__ = ["FRACTION_METRICS", "TaskScore", "base_metric", "format_value", "pick_headline", "unit_of"]
