"""One task's score on one report row (pydantic only: the report imports it)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TaskScore(BaseModel):
    """One task's result on one row."""

    task: str
    acc: float | None = None
    acc_stderr: float | None = None
    acc_norm: float | None = Field(None, description="length-normalized accuracy, where the task defines it")
    acc_norm_stderr: float | None = None
    items: int = Field(0, description="items scored (the limit, or the whole split)")
    split_items: int = Field(0, description="items in the split")
    num_fewshot: int = 0

    @property
    def metric(self) -> str:
        """The task's headline metric: acc_norm where the task has it, else acc."""
        return "acc_norm" if self.acc_norm is not None else "acc"

    @property
    def score(self) -> float | None:
        """The headline metric, in accuracy points (0-100)."""
        v = self.acc_norm if self.acc_norm is not None else self.acc
        return None if v is None else 100.0 * v

    @property
    def score_stderr(self) -> float | None:
        """The headline metric's standard error, in accuracy points."""
        v = self.acc_norm_stderr if self.acc_norm is not None else self.acc_stderr
        return None if v is None else 100.0 * v


__all__ = ["TaskScore"]
