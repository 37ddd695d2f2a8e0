"""MLflow tracking of a pipeline, read back from a real local store with MlflowClient."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optimize import load_config, run_pipeline
from optimize.errors import ConfigError
from train.tracking import MAX_PARAM_VALUE, flatten_params, numeric_leaves

REPO = Path(__file__).resolve().parents[2]


def test_flatten_params_dotted_keys_json_values_and_truncation():
    flat = flatten_params({"stages": [{"kind": "qat", "modules": None}], "data": {"seq_len": 128},
                           "export": {}, "flag": True, "long": "x" * 7000, "bad key!": 1})
    assert flat["stages.0.kind"] == "qat" and flat["stages.0.modules"] == "null"
    assert flat["data.seq_len"] == "128" and flat["export"] == "{}" and flat["flag"] == "true"
    assert len(flat["long"]) == MAX_PARAM_VALUE and flat["long"].endswith("…[truncated]")
    assert flat["bad key_"] == "1"
    assert numeric_leaves({"a": 1, "b": True, "c": None, "d": {"e": 2.5, "f": float("nan")}}) == {"a": 1.0, "d.e": 2.5}


def _client(uri):
    mlflow = pytest.importorskip("mlflow")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


def _only_run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_pipeline_run_is_recorded_params_metrics_steps_artifacts(tiny_cfg, tmp_path, capfd):
    uri = (tmp_path / "mlruns").as_uri()
    client = _client(uri)
    tiny_cfg["tracking"] = {"mlflow": {"tracking_uri": uri, "experiment": "edge", "run_name": "tiny-run"}}
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.1},
                          {"kind": "distill", "steps": 3, "seq_len": 32, "batch": {"micro_batch_size": 1}}]
    cfg = load_config(tiny_cfg)
    capfd.readouterr()
    report = run_pipeline(cfg)
    assert report.ok
    assert capfd.readouterr() == ("", "")  # MLflow's own output stays out of a quiet run too
    run = _only_run(client, "edge")
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-run"
    params = run.data.params
    assert params["stages.0.kind"] == "test_noise" and params["stages.1.kind"] == "distill"
    assert params["data.seq_len"] == "128" and params["tracking.mlflow.experiment"] == "edge"
    assert [params[f"row.{i}"] for i in range(3)] == ["baseline", "0:test_noise", "1:distill"]
    ppl = client.get_metric_history(run.info.run_id, "perplexity")
    assert sorted(m.step for m in ppl) == [0, 1, 2]
    by_step = {m.step: m.value for m in ppl}
    assert by_step[1] == pytest.approx(report.rows[1].metrics.perplexity)
    for key in ("perplexity_delta_pct", "top1_agreement", "kl_divergence", "size_mb", "wall_s", "peak_rss_mb"):
        assert len(client.get_metric_history(run.info.run_id, key)) >= 2, key
    loss = client.get_metric_history(run.info.run_id, "1:distill/train/loss")
    assert sorted(m.step for m in loss) == [1, 2, 3]  # live, per training step
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.json", "report.md", "report.png", "pipeline.log"} <= artifacts


def test_a_run_stopped_by_a_gate_is_failed_with_its_report(tiny_cfg, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    client = _client(uri)
    tiny_cfg["tracking"] = {"mlflow": {"tracking_uri": uri}}
    tiny_cfg["gates"] = {"top1_agreement": {"threshold": 0.999}}
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.3}, {"kind": "test_noise", "scale": 0.0}]
    report = run_pipeline(load_config(tiny_cfg))
    assert not report.ok
    run = _only_run(client, "tiny")  # experiment and run name default to the config's name
    assert run.info.status == "FAILED" and run.info.run_name == "tiny"
    assert run.data.tags["optimize.stopped_at"] == "0:test_noise"
    assert run.data.metrics["ok"] == 0.0
    assert {"report.json", "report.md"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_task_scores_and_other_row_figures_are_read_generically():
    from optimize.tracking import row_metrics

    row = {"index": 0, "name": "x", "kind": "k", "status": "pass", "wall_s": 1.5, "details": {"steps": 3},
           "metrics": {"perplexity": 9.0, "tasks": {"arc_easy": {"score": 41.0, "metric": "acc", "n": 20}}},
           "resources": {"device": "cpu", "peak_rss_mb": 100.0}, "gates": [], "error": None}
    assert row_metrics(row) == {"wall_s": 1.5, "perplexity": 9.0, "tasks.arc_easy.score": 41.0,
                                "tasks.arc_easy.n": 20.0, "peak_rss_mb": 100.0}


def test_missing_mlflow_is_refused_in_one_line(tiny_cfg, tmp_path, monkeypatch, capsys):
    import train.tracking as tracking
    from optimize.cli import main

    monkeypatch.setattr(tracking, "mlflow_installed", lambda: False)
    tiny_cfg["tracking"] = {"mlflow": {"tracking_uri": "file:./mlruns"}}
    with pytest.raises(ConfigError, match=r"tracking\.mlflow.*pip install"):
        load_config(tiny_cfg)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mlflow package is not installed" in err[0] and "pip install" in err[0], err


def test_importing_optimize_does_not_import_mlflow():
    code = ("import sys, optimize, optimize.config, optimize.pipeline, optimize.tracking, optimize.cli, train.api, "
            "train.tracking; print('mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_database_store_without_sqlalchemy_is_named(monkeypatch):
    import importlib.util

    import train.tracking as tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(tracking, "mlflow_installed", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    why = tracking.missing_package(tracking.TrackingConfig(mlflow={"tracking_uri": "sqlite:///m.db"}))
    assert why and "needs the full mlflow package" in why and "file: URI" in why
    assert tracking.missing_package(tracking.TrackingConfig(mlflow={"tracking_uri": "file:/tmp/m"})) is None
