"""The runner on a tiny model: checks fill the report, gates stop runs, work is never lost."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

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
    assert data["schema_version"] == "1.3" and Report.model_validate(data).rows[2].name == "noisy"
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
    assert [name for name, _ in report.warned_gates()] == ["0:test_noise", "1:test_noise"]
    assert report.verdict().startswith("finished with 2 gate(s) failed as warnings: 0:test_noise: ")
    md = (Path(report.output_dir) / "report.md").read_text()
    assert "all gates passed" not in md and "Result: **finished with 2 gate(s) failed as warnings" in md


def test_an_export_block_without_a_target_ends_saying_nothing_was_exported(tiny_cfg, capsys):
    """export.executorch options and no target: the stages run, no artifact is made, and the last line says
    so (the issue's run ended "ok: all gates passed" with nothing exported)."""
    from optimize.cli import main

    tiny_cfg["export"] = {"executorch": {"max_seq_len": 64}}
    tiny_cfg["checks"] = {"latency": {"enabled": False}}
    path = Path(tiny_cfg["output_dir"]).parent / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["pipeline", str(path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("ok: all gates passed · nothing exported: the export block sets export.executorch but "
                           "no target was given (pass --target executorch"), last
    from optimize.report import StageRow

    exported = Report(name="t", config={"export": {"executorch": {}}, "target": None},
                      rows=[StageRow(index=0, name="export:executorch", kind="export:executorch", runtime="executorch")])
    assert exported.nothing_exported() is None and exported.verdict() == "all gates passed"
    assert Report(name="t", config={"export": {}, "target": None}).verdict() == "all gates passed"


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


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
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


# ---- where the run computes (device, compute_dtype) and what each row cost


def test_auto_runs_here_and_stages_see_the_device_and_dtype(tiny_cfg):
    import torch

    tiny_cfg["stages"] = [{"kind": "test_where"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert report.environment["device"] == want and report.environment["compute_dtype"] == "float32"
    assert report.row("0:test_where").details == {"ctx_device": want, "ctx_dtype": "torch.float32",
                                                  "model_device": want, "model_dtype": "torch.float32",
                                                  "baseline_model": False}


def test_the_teacher_copy_is_kept_only_when_a_stage_reads_it(tiny_cfg, monkeypatch):
    """No stage that reads ctx.baseline_model: the run holds one model (a 1B model on a 24 GiB
    machine has no room for two). With distill in the list, every stage sees the copy."""
    import copy as copy_mod

    from optimize import pipeline

    copies = []
    real = copy_mod.deepcopy
    monkeypatch.setattr(pipeline.copy, "deepcopy", lambda obj, *a: copies.append(type(obj).__name__) or real(obj, *a))
    tiny_cfg["stages"] = [{"kind": "test_where"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.row("0:test_where").details["baseline_model"] is False
    assert "LlamaForCausalLM" not in copies
    tiny_cfg["stages"] = [{"kind": "test_where"}, {"kind": "distill", "steps": 1, "seq_len": 32}]
    tiny_cfg["resume"] = False
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok, report.rows[-1].error
    assert report.row("0:test_where").details["baseline_model"] is True


def test_compute_dtype_places_the_model_and_the_export_gets_it_back_on_cpu_in_fp32(tiny_cfg, monkeypatch):
    """Stages and checks see bfloat16 weights; the exporter gets the CPU fp32 model it always got."""
    import torch

    from optimize import pipeline

    seen = {}

    def fake_export(state, model, report, draft=None):
        p = next(model.parameters())
        seen.update(device=p.device.type, dtype=p.dtype, all_fp32=all(q.dtype == torch.float32 for q in model.parameters()))

    monkeypatch.setattr(pipeline, "export_rows", fake_export)
    tiny_cfg.update(device="cpu", compute_dtype="bfloat16", target="executorch")
    tiny_cfg["stages"] = [{"kind": "test_where"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok and report.environment["compute_dtype"] == "bfloat16"
    assert report.row("0:test_where").details["model_dtype"] == "torch.bfloat16"
    assert report.row("0:test_where").details["ctx_dtype"] == "torch.bfloat16"
    assert seen == {"device": "cpu", "dtype": torch.float32, "all_fp32": True}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_explicit_cpu_and_float32_give_the_result_of_the_defaults(tiny_cfg, tiny_config, tmp_path, family):
    """``device: cpu`` and ``compute_dtype: float32`` on an fp32 model are what a run always did: the
    same GPTQ stage gives the same figures as a run that names neither."""
    base = dict(tiny_cfg, model=dict(tiny_cfg["model"], config=tiny_config(family)))
    base["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "algorithm": "gptq", "gptq": {"calibration_windows": 1}}]
    base["checks"] = dict(base["checks"], latency={"enabled": False})
    default = run_pipeline(load_config(base), output_dir=tmp_path / "default", say=lambda m: None)
    explicit = run_pipeline(load_config(dict(base, device="cpu", compute_dtype="float32")),
                            output_dir=tmp_path / "explicit", say=lambda m: None)
    a, b = default.row("0:ptq_int8"), explicit.row("0:ptq_int8")
    assert a.status == b.status == "pass"
    assert a.metrics.perplexity == b.metrics.perplexity and a.metrics.kl_divergence == b.metrics.kl_divergence
    assert a.details["gptq"] == b.details["gptq"]


def test_every_row_reports_its_time_device_and_peak_memory(tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.01}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    import os

    total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    for row in report.rows:
        res = row.resources
        assert row.wall_s > 0 and res is not None and res.device == report.environment["device"]
        # the process holds torch and a model: tens of MiB at least, never more than the machine
        assert 50 < res.peak_rss_mb < total_mb and 0 <= res.peak_rss_delta_mb <= res.peak_rss_mb
        assert (res.peak_cuda_mb is None) == (res.device == "cpu")
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["rows"][1]["resources"]["peak_rss_mb"] == report.rows[1].resources.peak_rss_mb
    md = (tmp_path / "run" / "report.md").read_text()
    assert "## Time and memory per row" in md and "- 0:test_noise: " in md and "peak RSS" in md


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_calibration_stages_on_cuda_match_the_cpu_run(tiny_cfg, tiny_config, tmp_path, family):
    """distill -> AWQ -> GPTQ with ``device: cuda`` against the same YAML with ``device: cpu``:
    every row within 1% perplexity, the checks ran on the GPU, the export row is absent (no
    target) and the model came back from the GPU intact (the report has its CUDA peaks)."""
    base = dict(tiny_cfg, model=dict(tiny_cfg["model"], config=tiny_config(family)))
    base["stages"] = [
        {"kind": "distill", "steps": 3, "seq_len": 32},
        {"kind": "awq", "rows": 32, "keep_high_precision": []},
        {"kind": "ptq_int8", "scheme": "8da4w", "algorithm": "gptq", "keep_high_precision": []},
    ]
    base["checks"] = dict(base["checks"], latency=dict(base["checks"]["latency"], eager_quantized=True))
    runs = {d: run_pipeline(load_config(dict(base, device=d)), output_dir=tmp_path / d, say=lambda m: None)
            for d in ("cpu", "cuda")}
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert cpu.ok and gpu.ok, (cpu.stopped_at, gpu.stopped_at, [r.error for r in gpu.rows])
    assert gpu.environment["device"].startswith("cuda") and cpu.environment["device"] == "cpu"
    for a, b in zip(cpu.rows, gpu.rows):
        assert a.name == b.name
        assert b.metrics.perplexity == pytest.approx(a.metrics.perplexity, rel=0.01), a.name
        assert b.resources.peak_cuda_mb > 0 and a.resources.peak_cuda_mb is None
        assert b.metrics.prefill_ms > 0 and b.metrics.decode_tok_s > 0
