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
    def one(t, a, n):
        metrics = {"acc": a, **({"acc_norm": n} if n is not None else {})}
        return TaskScore(task=t, metrics=metrics, stderr={"acc_norm": 0.02} if n is not None else {},
                         higher_is_better={k: True for k in metrics}, headline="acc_norm" if n is not None else "acc",
                         items=50, split_items=10042)

    return Metrics(tasks={t: one(t, a, n) for t, (a, n) in scores.items()})


def _ppl(task, word_ppl, bpb):
    return Metrics(tasks={task: TaskScore(task=task, output_type="loglikelihood_rolling",
                                          metrics={"word_perplexity": word_ppl, "bits_per_byte": bpb},
                                          higher_is_better={"word_perplexity": False, "bits_per_byte": False},
                                          headline="word_perplexity", items=20, split_items=20)})


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


def test_perplexity_task_gates_in_their_own_units():
    """A perplexity-type task is gated in its own units and direction: word perplexity in percent of
    the baseline, bits per byte as a ceiling; a goal on a metric the row lacks fails by name."""
    base = _ppl("own_text", 20.0, 1.00)
    gates = GatesConfig(tasks={"own_text": {"max_pct_degradation": 5}})
    (ok,) = evaluate_gates(gates, _ppl("own_text", 20.8, 1.01), base)
    assert ok.ok and "own_text word_perplexity 20.8 vs baseline 20 on 20 items: worsened by 4.00%" in ok.message
    (bad,) = evaluate_gates(gates, _ppl("own_text", 21.2, 1.02), base)
    assert not bad.ok and "worsened by 6.00% (allowed 5%)" in bad.message
    ceiling = GatesConfig(tasks={"own_text": {"metric": "bits_per_byte", "threshold": 1.015}})
    assert [g.ok for g in evaluate_gates(ceiling, _ppl("own_text", 30, 1.01), base)] == [True]
    (over,) = evaluate_gates(ceiling, _ppl("own_text", 19, 1.02), base)
    assert not over.ok and "bits_per_byte 1.02 bits/byte on 20 items misses threshold <= 1.015" in over.message
    assert over.metric == "tasks.own_text.bits_per_byte"
    (none,) = evaluate_gates(GatesConfig(tasks={"own_text": {"metric": "acc", "threshold": 1}}), base, base)
    assert not none.ok and "it has: word_perplexity, bits_per_byte" in none.message


def test_stage_gates_replace_task_goals_one_by_one():
    merged = GatesConfig(tasks={"piqa": {"max_degradation": 1}, "arc_easy": {"threshold": 30}}).merged_with(
        GatesConfig(tasks={"piqa": {"max_degradation": 5}}))
    assert merged.tasks["piqa"].max_degradation == 5 and merged.tasks["arc_easy"].threshold == 30


@needs_tasks
@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_pipeline_scores_rows_writes_the_table_and_a_task_gate_stops_the_run(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.05}]
    tiny_cfg["checks"]["accuracy"] = False
    tiny_cfg["checks"]["latency"]["enabled"] = False
    from tests.optimize.tasks.user_tasks import write_user_tasks

    user = write_user_tasks(Path(tiny_cfg["output_dir"]).parent / "my_tasks")
    tiny_cfg["checks"]["tasks"] = {"names": ["arc_easy", "winogrande", "own_text", "keyword_qa"], "limit": 6,
                                   "rows": ["baseline", "0:test_noise"], "include_path": [str(user)]}
    tiny_cfg["gates"] = {"tasks": {"winogrande": {"threshold": 100.0}}}
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    data = json.loads((Path(tiny_cfg["output_dir"]) / "report.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("baseline", "0:test_noise"):
        tasks = rows[name]["metrics"]["tasks"]
        assert set(tasks) == {"arc_easy", "winogrande", "own_text", "keyword_qa"}
        assert tasks["own_text"]["headline"] == "word_perplexity" and tasks["own_text"]["metrics"]["bits_per_byte"] > 0
        assert tasks["keyword_qa"]["output_type"] == "generate_until" and tasks["keyword_qa"]["items"] == 4
        assert tasks["arc_easy"]["items"] == 6 and tasks["arc_easy"]["split_items"] == 570
        assert 0 <= tasks["arc_easy"]["metrics"]["acc_norm"] <= 1 and "acc_norm" not in tasks["winogrande"]["metrics"]
        assert tasks["arc_easy"]["headline"] == "acc_norm" and tasks["winogrande"]["headline"] == "acc"
        assert rows[name]["details"]["tasks"]["runtime"] == "eager" and rows[name]["details"]["tasks"]["generated"] > 0
    assert not report.ok and report.stopped_at == "0:test_noise"
    (gate,) = report.row("0:test_noise").gates
    assert gate.metric == "tasks.winogrande" and not gate.ok
    assert "winogrande acc" in gate.message and "on 6 items (limit of 1267)" in gate.message
    md = (Path(tiny_cfg["output_dir"]) / "report.md").read_text()
    assert "## Tasks" in md and "| arc_easy | acc_norm | 6/570 |" in md
    assert "| own_text | word_perplexity | 6/6 |" in md and "| keyword_qa | exact_match,first_word | 4/4 |" in md


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
        assert exp.metrics.tasks[t].metrics == base.metrics.tasks[t].metrics
