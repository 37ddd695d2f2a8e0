"""Optional experiment tracking in MLflow: the ``tracking`` block of a training recipe and of a
pipeline YAML, and the one run writer both use.

    tracking:
      mlflow:
        tracking_uri: file:./mlruns     # or sqlite:///mlflow.db, http://host:5000; default: MLflow's own
        experiment: edge-models         # default: the run's name
        run_name: smollm-8da4w          # default: the run's name

MLflow is an optional extra (``pip install 'edge-optimize[tracking]'``, which installs
``mlflow-skinny``); it is imported only when a run with this block starts, never when the
packages import. A configured block without the package is refused before anything runs
(:func:`missing_package`). The writer talks to the store through ``MlflowClient`` (no global
active run is started or changed, so an embedding program's own MLflow runs are untouched), and
a tracking failure mid-run is reported once and ends tracking, never the run.

This module lives in ``train`` because both ``train`` and ``optimize`` use it (imports point
``optimize`` → ``train``); :mod:`optimize.tracking` re-exports it and adds the pipeline's rows.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import Field

from targets.config_base import Strict

log = logging.getLogger("optimize.tracking")

INSTALL_HINT = "pip install 'edge-optimize[tracking]' (or: pip install mlflow-skinny)"

#: MLflow's own limits (mlflow.utils.validation): param values, keys, entries per log_batch call
MAX_PARAM_VALUE = 6000
MAX_KEY = 250
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000


class MlflowConfig(Strict):
    """Where the run is recorded in MLflow."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI: file:<dir>, sqlite:///<file>.db (needs the full mlflow package), "
        "http(s)://<server>; null uses MLflow's default (MLFLOW_TRACKING_URI, else ./mlruns)"
    )
    experiment: str | None = Field(None, min_length=1, description="experiment name (created if missing); "
                                   "default: the run's name")
    run_name: str | None = Field(None, min_length=1, description="MLflow run name; default: the run's name")
    tags: dict[str, str] = Field(default_factory=dict, description="extra tags set on the run")


class TrackingConfig(Strict):
    """Experiment tracking; only MLflow today."""

    mlflow: MlflowConfig | None = Field(None, description="record params, metrics and artifacts in MLflow")


def mlflow_installed() -> bool:
    return importlib.util.find_spec("mlflow") is not None


def missing_package(cfg: TrackingConfig | None) -> str | None:
    """One sentence when tracking is configured but its package is not installed, else None."""
    if cfg is None or cfg.mlflow is None:
        return None
    if not mlflow_installed():
        return f"MLflow tracking is configured but the mlflow package is not installed; {INSTALL_HINT}"
    uri = cfg.mlflow.tracking_uri or ""
    if uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql") and (
            importlib.util.find_spec("sqlalchemy") is None or importlib.util.find_spec("alembic") is None):
        return (f"tracking_uri {uri.split(':', 1)[0]}:// is a database store, which needs the full mlflow package "
                "(mlflow-skinny has only the file store and the client); pip install mlflow, or use a file: URI")
    return None


# ---- flattening


_KEY_BAD = re.compile(r"[^\w\-. /:]")


def _key(k: str) -> str:
    """A valid MLflow key: alphanumerics, _ - . space / :, at most 250 characters."""
    return _KEY_BAD.sub("_", k)[:MAX_KEY]


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


def config_params(config: dict) -> dict[str, str]:
    """A config (pipeline or recipe, as JSON) as params, without the tracking URI (it may hold credentials)."""
    params = flatten_params(config)
    params.pop("tracking.mlflow.tracking_uri", None)
    return params


def flatten_params(data: Any, prefix: str = "") -> dict[str, str]:
    """``{"stages": [{"kind": "qat"}]}`` → ``{"stages.0.kind": "qat"}``: one string per leaf; an
    empty list or mapping is kept as ``[]`` / ``{}``. Values longer than MLflow's limit are cut
    to fit, ending in ``…[truncated]``."""
    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, (list, tuple)) and node:
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}" if key else str(i))
        else:
            text = _value(node)
            if len(text) > MAX_PARAM_VALUE:
                tail = "…[truncated]"
                text = text[: MAX_PARAM_VALUE - len(tail)] + tail
            out[_key(key or "value")] = text

    walk(data, prefix)
    return out


def numeric_leaves(data: Any, prefix: str = "") -> dict[str, float]:
    """Every finite int/float leaf (bools excluded) of a nested mapping, by dotted key."""
    out: dict[str, float] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, bool) or node is None:
            return
        elif isinstance(node, (int, float)) and math.isfinite(node):
            out[_key(key)] = float(node)

    walk(data, prefix)
    return out


# ---- the run


def _chunks(items: list, n: int) -> Iterable[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _is_file_store(uri: str | None) -> bool:
    if uri is None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
    return uri is None or uri.startswith("file:") or "://" not in uri and not uri.startswith("databricks")


class MlflowRun:
    """One MLflow run, written through ``MlflowClient``. Every method is a no-op once a call
    failed (the failure is reported through ``say`` once): tracking never stops a run."""

    def __init__(self, cfg: MlflowConfig, default_name: str, *, say: Callable[[str], None] | None = None,
                 tags: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.say = say or log.warning
        self.run_id: str | None = None
        self.client = None
        self.failed: str | None = None
        self._guard(self._start, default_name, {**(tags or {}), **cfg.tags})

    # every call to MLflow goes through here: its warnings stay out of the output, errors end tracking
    def _guard(self, fn: Callable, *args, **kwargs):
        if self.failed is not None:
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop the run
            self.failed = f"{type(exc).__name__}: {exc}"
            self.say(f"tracking: MLflow failed ({self.failed}); the run continues without tracking")
            return None

    def _start(self, default_name: str, tags: dict[str, str]) -> None:
        # MLflow 3 refuses its file store unless asked: a configured file: URI is that request
        if _is_file_store(self.cfg.tracking_uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for name in ("mlflow", "alembic", "databricks", "urllib3"):
            lg = logging.getLogger(name)
            if lg.level == logging.NOTSET:
                lg.setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.cfg.tracking_uri)
        name = self.cfg.experiment or default_name
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        run = self.client.create_run(exp_id, run_name=self.cfg.run_name or default_name,
                                     tags={k: str(v) for k, v in tags.items()})
        self.run_id = run.info.run_id

    @property
    def active(self) -> bool:
        return self.run_id is not None and self.failed is None

    def log_params(self, params: dict[str, str]) -> None:
        if not self.active:
            return
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for chunk in _chunks(items, MAX_PARAMS_PER_BATCH):
            self._guard(self.client.log_batch, self.run_id, params=chunk)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.active or not metrics:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items()
                 if v is not None and math.isfinite(float(v))]
        for chunk in _chunks(items, MAX_METRICS_PER_BATCH):
            self._guard(self.client.log_batch, self.run_id, metrics=chunk)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if not self.active:
            return
        from mlflow.entities import RunTag

        items = [RunTag(_key(k), str(v)[:5000]) for k, v in tags.items()]
        self._guard(self.client.log_batch, self.run_id, tags=items)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.active and Path(path).is_file():
            self._guard(self.client.log_artifact, self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        """FINISHED, FAILED or KILLED."""
        if self.run_id is None or self.client is None:
            return
        try:  # even after a failed call: a run left RUNNING in the store misleads whoever reads it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.client.set_terminated(self.run_id, status)
        except Exception:  # noqa: BLE001
            pass


#: per-step fields of the training loop's metric rows (train/metrics.py) that become MLflow metrics
TRAIN_STEP_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mib", "seq_len",
                      "micro_batch_size", "grad_accum_steps")


def train_step_metrics(row: dict) -> dict[str, float]:
    return {k: float(row[k]) for k in TRAIN_STEP_METRICS
            if isinstance(row.get(k), (int, float)) and not isinstance(row.get(k), bool)}


__all__ = [
    "INSTALL_HINT",
    "MlflowConfig",
    "MlflowRun",
    "TrackingConfig",
    "config_params",
    "flatten_params",
    "missing_package",
    "mlflow_installed",
    "numeric_leaves",
    "train_step_metrics",
]
