"""The pipeline's MLflow record: the ``tracking`` block of the pipeline YAML.

    tracking:
      mlflow: {tracking_uri: "file:./mlruns", experiment: edge, run_name: smollm-8da4w}

With the block, :func:`optimize.pipeline.run_pipeline` records one MLflow run:

- **params**: the validated config flattened to dotted keys (``stages.0.kind``, ``data.seq_len``),
  values cut to MLflow's length limit; ``row.<step>`` names the report row behind each step;
- **metrics**: every numeric figure of every report row (perplexity, delta, top-1, KL, size,
  latency, wall time, peak memory, and whatever else a row holds, task scores included), with
  ``step`` = the row's position in the report (0 = baseline, then the stages, then each export
  artifact); while a stage trains, its loss and tokens/s per training step as
  ``<row>/<phase>/loss`` (e.g. ``1:distill/train/loss``), stepped by the training step;
- **artifacts**: ``report.json``, ``report.md``, ``report.png``, each export's ``manifest.json``
  and ``pipeline.log``, written at the end even when a gate stopped the run; the run ends
  FINISHED when the report is ok, FAILED when a gate or a stage stopped it (KILLED on Ctrl-C).

The models and the run writer are in :mod:`train.tracking` (``optimize train`` records the same
way); mlflow itself is imported only when a run with the block starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from train.tracking import (
    INSTALL_HINT,
    MlflowConfig,
    MlflowRun,
    TrackingConfig,
    config_params,
    flatten_params,
    missing_package,
    mlflow_installed,
    numeric_leaves,
)

#: row fields that are labels or free-form, not figures
_NOT_FIGURES = {"index", "name", "kind", "runtime", "status", "gates", "artifact", "details", "error"}


def row_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The numeric figures of one report row (``StageRow.model_dump(mode="json")``), read
    generically: ``metrics`` and ``resources`` by their own keys (``perplexity``,
    ``peak_rss_mb``), any other numeric field by its dotted path (``wall_s``, ``tasks.arc.acc``)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in _NOT_FIGURES:
            continue
        if key in ("metrics", "resources") and isinstance(value, dict):
            out.update(numeric_leaves(value))
        else:
            out.update(numeric_leaves({key: value}))
    return out


class PipelineTracker:
    """One pipeline run in MLflow (see the module docstring)."""

    def __init__(self, run: MlflowRun) -> None:
        self.run = run

    @classmethod
    def start(cls, cfg, run_dir: Path, say: Callable[[str], None]) -> "PipelineTracker | None":
        """None unless the config has a ``tracking.mlflow`` block."""
        tracking = getattr(cfg, "tracking", None)
        if tracking is None or tracking.mlflow is None:
            return None
        import json

        run = MlflowRun(tracking.mlflow, cfg.name, say=say,
                        tags={"optimize.kind": "pipeline", "optimize.target": str(cfg.target),
                              "optimize.run_dir": str(run_dir)})
        if run.active:
            run.log_params(config_params(json.loads(cfg.model_dump_json())))
            say(f"tracking: MLflow run {run.run_id} ({tracking.mlflow.tracking_uri or 'default store'})")
        return cls(run)

    def on_progress(self, ev) -> None:
        """Training steps (events with a loss) as live metrics of the row that trains."""
        if ev.event != "step" or ev.step is None:
            return
        figures = {"loss": ev.loss, "tokens_per_s": ev.tokens_per_s}
        figures = {f"{ev.stage}/{ev.phase}/{k}": v for k, v in figures.items() if v is not None}
        if figures:
            self.run.log_metrics(figures, ev.step)

    def finish(self, report, paths: dict[str, Path], status: str, log_file: Path | None = None) -> None:
        run = self.run
        rows = [r.model_dump(mode="json") for r in report.rows]
        run.log_params({f"row.{i}": r["name"] for i, r in enumerate(rows)})
        for i, r in enumerate(rows):
            run.log_metrics(row_metrics(r), step=i)
        run.log_metrics({"ok": float(report.ok), "wall_s_total": report.wall_s}, step=max(len(rows) - 1, 0))
        run.set_tags({"optimize.verdict": report.verdict(), "optimize.stopped_at": report.stopped_at or "",
                      "optimize.last_good_artifact": report.last_good_artifact or ""})
        for key in ("json", "md", "png"):
            if key in paths:
                run.log_artifact(paths[key])
        out = Path(report.output_dir) if report.output_dir else None
        if out is not None:
            for manifest in sorted(out.glob("export/*/manifest.json")):
                run.log_artifact(manifest, f"export/{manifest.parent.name}")
        if log_file is not None:
            run.log_artifact(log_file)
        run.end(status)


__all__ = [
    "INSTALL_HINT",
    "MlflowConfig",
    "MlflowRun",
    "PipelineTracker",
    "TrackingConfig",
    "flatten_params",
    "missing_package",
    "mlflow_installed",
    "row_metrics",
]
