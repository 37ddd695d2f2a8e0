"""checks.tasks in a pipeline run: the task table in report.json and report.md, and task gates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optimize import load_config, run_pipeline
from optimize.gates import evaluate_gates
from optimize.gates_config import GatesConfig
from optimize.report import Metrics
from optimize.tasks.data import missing_packages
from optimize.tasks.scores import TaskScore

needs_tasks = pytest.mark.skipif(bool(missing_packages()), reason="; ".join(missing_packages()))


def _m(**scores):
    return Metrics(tasks={t: TaskScore(task=t, acc=a, acc_norm=n, acc_norm_stderr=0.02, items=50, split_items=10042)
                          for t, (a, n) in scores.items()})


def test_task_gates_on_the_headline_metric_in_points():
    base = _m(hellaswag=(0.30, 0.40), winogrande=(0.52, None))
    gates = GatesConfig(tasks={"hellaswag": {"max_degradation": 2.0}, "winogrande": {"threshold": 50}})
    ok = evaluate_gates(gates, _m(hellaswag=(0.20, 0.385), winogrande=(0.51, None)), base)
    assert [g.ok for g in ok] == [True, True]
    bad = evaluate_gates(gates, _m(hellaswag=(0.30, 0.37), winogrande=(0.49, None)), base)
    assert [g.ok for g in bad] == [False, False]
    msg = bad[0].message
    assert msg.startswith("hellaswag acc_norm 37.0 ± 2.0 vs baseline 40.0 points on 50 items (limit of 10042)")
    assert "worsened by 3.0 points (allowed 2)" in msg
    assert "winogrande acc 49.0" in bad[1].message and "misses threshold >= 50" in bad[1].message
    # a row whose tasks were not scored is not gated on them; a scored row missing one fails
    assert evaluate_gates(gates, Metrics(), base) == []
    (miss, _) = evaluate_gates(gates, _m(winogrande=(0.6, None)), base)
    assert not miss.ok and "not scored" in miss.message


def test_stage_gates_replace_task_goals_one_by_one():
    merged = GatesConfig(tasks={"piqa": {"max_degradation": 1}, "arc_easy": {"threshold": 30}}).merged_with(
        GatesConfig(tasks={"piqa": {"max_degradation": 5}}))
    assert merged.tasks["piqa"].max_degradation == 5 and merged.tasks["arc_easy"].threshold == 30


@needs_tasks
def test_pipeline_scores_rows_writes_the_table_and_a_task_gate_stops_the_run(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.05}]
    tiny_cfg["checks"]["accuracy"] = False
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["checks"]["tasks"] = {"names": ["arc_easy", "winogrande"], "limit": 6,
                                   "rows": ["baseline", "0:test_noise"]}
    tiny_cfg["gates"] = {"tasks": {"winogrande": {"threshold": 100.0}}}
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    data = json.loads((Path(tiny_cfg["output_dir"]) / "report.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("baseline", "0:test_noise"):
        tasks = rows[name]["metrics"]["tasks"]
        assert set(tasks) == {"arc_easy", "winogrande"}
        assert tasks["arc_easy"]["items"] == 6 and tasks["arc_easy"]["split_items"] == 570
        assert 0 <= tasks["arc_easy"]["acc_norm"] <= 1 and tasks["winogrande"]["acc_norm"] is None
        assert rows[name]["details"]["tasks"]["runtime"] == "eager"
    assert not report.ok and report.stopped_at == "0:test_noise"
    (gate,) = report.row("0:test_noise").gates
    assert gate.metric == "tasks.winogrande" and not gate.ok
    assert "winogrande acc" in gate.message and "on 6 items (limit of 1267)" in gate.message
    md = (Path(tiny_cfg["output_dir"]) / "report.md").read_text()
    assert "## Tasks" in md and "| arc_easy | acc_norm | 6/570 |" in md


@needs_tasks
@pytest.mark.slow
def test_the_export_row_is_scored_in_its_runtime(tiny_cfg):
    """An fp32 ExecuTorch export scores what eager scores. The .pte's forward returns only the last
    position's logits, so checks.tasks has the exporter add forward_all, and scoring goes through it."""
    tiny_cfg.update(target="executorch")
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["checks"]["generate_tokens"] = 0
    tiny_cfg["checks"]["tasks"] = {"names": ["arc_easy", "piqa"], "limit": 5}
    tiny_cfg["gates"] = {"tasks": {"arc_easy": {"max_degradation": 0.0}, "piqa": {"max_degradation": 0.0}}}
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok, report.verdict()
    base, exp = report.rows[0], report.rows[-1]
    assert exp.runtime == "executorch" and exp.details["tasks"]["runtime"] == "executorch"
    assert exp.details["tasks"]["method"] == "forward_all" and exp.details["llm_ops"]["scoring_method"] == "forward_all"
    assert exp.details["tasks"]["contexts"] < exp.details["tasks"]["requests"]  # choices shared their context
    for t in ("arc_easy", "piqa"):
        assert exp.metrics.tasks[t].acc == base.metrics.tasks[t].acc
        assert exp.metrics.tasks[t].acc_norm == base.metrics.tasks[t].acc_norm
