"""The runner on a tiny model: checks fill the report, gates stop runs, work is never lost."""

from __future__ import annotations

import json
import math

import pytest

from optimize import load_config, run_pipeline
from optimize.report import Report


def test_runs_stages_and_writes_full_report(tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.0}, {"kind": "test_noise", "scale": 0.05, "name": "noisy"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok and report.exit_code == 0
    assert [r.name for r in report.rows] == ["baseline", "0:test_noise", "noisy"]
    base, same, noisy = report.rows
    assert base.metrics.perplexity > 1 and base.metrics.eval_tokens == 256
    # a stage that changes nothing measures exactly like the baseline
    assert same.metrics.perplexity == pytest.approx(base.metrics.perplexity, rel=1e-6)
    # KL's floor is the fp16 storage of the baseline log-probs (documented in checks.accuracy)
    assert same.metrics.top1_agreement == 1.0 and same.metrics.kl_divergence == pytest.approx(0.0, abs=1e-4)
    # noise costs agreement and KL
    assert noisy.metrics.top1_agreement < 1.0 and noisy.metrics.kl_divergence > 0
    for r in report.rows:
        m = r.metrics
        assert m.params == base.metrics.params and m.size_mb > 0
        assert m.prefill_ms > 0 and m.decode_tok_s > 0 and m.prefill_tokens == 16
    assert noisy.details == {"scale": 0.05}
    run = tmp_path / "run"
    data = json.loads((run / "report.json").read_text())
    assert data["schema_version"] == "1.0" and Report.model_validate(data).rows[2].name == "noisy"
    assert data["data"]["eval"] == {"start": 0, "stop": 257, "tokens": 257}
    assert data["data"]["calibration"]["start"] == 257  # calibration never overlaps evaluation
    md = (run / "report.md").read_text()
    assert "| noisy | eager |" in md and "rest on 256 tokens" in md
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failed_gate_stops_keeps_last_good_and_writes_report(tiny_cfg, tmp_path):
    tiny_cfg["gates"] = {"top1_agreement": {"threshold": 0.95}}
    tiny_cfg["stages"] = [
        {"kind": "test_noise", "scale": 0.0},
        {"kind": "test_noise", "scale": 0.2, "name": "too-noisy"},
        {"kind": "test_noise", "scale": 0.0, "name": "never-runs"},
    ]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert not report.ok and report.exit_code == 1
    assert report.stopped_at == "too-noisy"
    assert [r.name for r in report.rows] == ["baseline", "0:test_noise", "too-noisy"]
    failed = report.rows[-1]
    assert failed.status == "fail" and not failed.gates[0].ok
    assert "misses threshold >= 0.95" in failed.gates[0].message
    assert report.last_good_artifact and "00-test_noise" in report.last_good_artifact
    assert (tmp_path / "run" / "report.json").exists()
    assert "STOPPED at too-noisy" in (tmp_path / "run" / "report.md").read_text()


def test_warn_gate_continues(tiny_cfg):
    tiny_cfg["gates"] = {"on_fail": "warn", "top1_agreement": {"threshold": 0.999}}
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.2}, {"kind": "test_noise", "scale": 0.0}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok and [r.status for r in report.rows[1:]] == ["warn", "warn"]


def test_per_stage_gate_override(tiny_cfg):
    tiny_cfg["gates"] = {"top1_agreement": {"threshold": 0.999}}
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.2, "gates": {"top1_agreement": {"threshold": 0.0}}}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok and report.rows[1].gates[0].goal == {"threshold": 0.0}


def test_crashing_stage_is_reported_and_earlier_work_kept(tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.0}, {"kind": "test_boom"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert not report.ok and report.stopped_at == "1:test_boom"
    assert report.rows[-1].status == "error" and "boom: this stage always fails" in report.rows[-1].error
    assert "00-test_noise" in report.last_good_artifact
    assert "## Errors" in (tmp_path / "run" / "report.md").read_text()


def test_rerun_resumes_and_edit_invalidates_from_changed_stage(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.01}, {"kind": "test_noise", "scale": 0.02}]
    first = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    messages: list[str] = []
    again = run_pipeline(load_config(tiny_cfg), say=messages.append)
    assert [r.status for r in again.rows[1:]] == ["resumed", "resumed"]
    assert any("resuming: all 2 stages finished" in m for m in messages)
    assert again.rows[2].metrics.perplexity == first.rows[2].metrics.perplexity
    # editing stage 1 keeps stage 0's checkpoint and reruns stage 1
    messages.clear()
    edited = run_pipeline(load_config(tiny_cfg, ["stages.1.scale=0.03"]), say=messages.append)
    assert [r.status for r in edited.rows[1:]] == ["resumed", "pass"]
    assert any("starting at stage 1" in m for m in messages)
    # a resumed model is the same model: re-measuring it gives the same figures
    tiny_cfg["resume"] = False
    fresh = run_pipeline(load_config(tiny_cfg, ["stages.1.scale=0.03"]), say=lambda m: None)
    assert math.isclose(fresh.rows[2].metrics.perplexity, edited.rows[2].metrics.perplexity, rel_tol=1e-6)
