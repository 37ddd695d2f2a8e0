"""MLflow tracking of a training recipe, read back from a real local store."""

from __future__ import annotations

import os

import pytest

from tests.train.conftest import tiny_recipe
from train.api import run_training
from train.recipe import RecipeError, parse_recipe


def test_training_run_records_recipe_steps_and_report(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    recipe = tiny_recipe(tmp_path / "out", max_steps=4, checkpoint=dict(save_final=False, export_hf=False),
                         logging=dict(progress_bar=False, every_n_steps=2))
    recipe["tracking"] = {"mlflow": {"tracking_uri": uri, "experiment": "train-exp"}}
    report = run_training(parse_recipe(recipe))

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("train-exp")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "out"  # default: the output dir's name
    params = run.data.params
    assert params["train.max_steps"] == "4" and params["model.source"] == "random" and params["data.seq_len"] == "64"
    loss = client.get_metric_history(run.info.run_id, "loss")
    # every step, read back in bursts of logging.every_n_steps
    assert sorted(m.step for m in loss) == [1, 2, 3, 4]
    assert {m.step: m.value for m in loss} == pytest.approx({int(k): v for k, v in report.losses.items()})
    for key in ("tokens_per_s", "peak_mem_mib", "lr", "grad_norm"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 4, key
    assert run.data.metrics["run.final_loss"] == pytest.approx(report.final_loss)
    assert {"report.json", "metrics.csv"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_missing_mlflow_refuses_the_recipe_in_one_line(tmp_path, monkeypatch):
    import train.tracking as tracking

    monkeypatch.setattr(tracking, "mlflow_installed", lambda: False)
    recipe = tiny_recipe(tmp_path / "out")
    recipe["tracking"] = {"mlflow": {}}
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe, "r.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("r.yaml: tracking.mlflow: ") and "pip install" in msg


def test_unknown_tracking_key_is_refused(tmp_path):
    recipe = tiny_recipe(tmp_path / "out")
    recipe["tracking"] = {"mlflow": {"uri": "file:x"}}
    with pytest.raises(RecipeError, match="tracking.mlflow: unknown key .uri.; allowed keys: experiment, run_name"):
        parse_recipe(recipe, "r.yaml")
