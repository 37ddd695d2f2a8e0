"""The run's export step: export the final model (or reuse the export an earlier run of this
directory made), then one gated row per artifact, each measured in its own runtime against eager.

Why apart from :mod:`optimize.pipeline`: the runner decides the order of a run; this module owns
what an export row is (its cache, its verification, its memory in a child process, the device's
gates and the target's budgets), as :mod:`optimize.stage_rows` owns the stages' rows.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from export.base import DraftSpec, ExportResult, get_exporter
from optimize import export_cache
from optimize.config import PipelineConfigBase
from optimize.checks.arm64 import arm64_gates, measure_arm64
from optimize.config_checks import export_options
from optimize.draft_rows import token_counts
from optimize.footprint.memory import MemoryFootprint, footprint
from optimize.footprint.predict import bytes_by_scheme, device_gates, packed_copy_bytes, predict, weight_bytes_per_token
from optimize.gates_config import GateResult, GatesConfig, MetricGoal
from optimize.measure import RunState, checks_key, measure_runner, score_row_tasks
from optimize.progress import current_hub
from optimize.report import Report, StageRow
from optimize.resources import PeakMemory
from optimize.rows import record_error, record_gated
from targets.devices import host_bandwidth, load_device

log = logging.getLogger("optimize")


def export_rows(state: RunState, model: torch.nn.Module, report: Report, *,
                draft: torch.nn.Module | None = None) -> None:
    """Export (or reuse a cached export of) the final model, with ``draft`` (the draft block's model)
    beside it; one gated row per artifact."""
    cfg, profile = state.cfg, state.profile
    exporter = get_exporter(profile.exporter)
    options = export_options(cfg, profile.exporter, profile)
    extra = {}
    if draft is not None:  # validate refused the draft block for exporters without drafts
        vocab = int(model.get_input_embeddings().num_embeddings)
        extra["draft"] = DraftSpec(draft, token_counts(state, vocab) if getattr(options, "draft_vocab", None) else None)
    out_dir = state.run_dir / "export" / profile.name
    label = f"export:{profile.name}"
    t0 = time.perf_counter()
    cpu = torch.device("cpu")
    cache_file = export_cache.cache_path(state.run_dir, profile.name)
    key = export_cache.export_key(state.model_digest, profile, options)
    measured_with = checks_key(cfg)
    entry = export_cache.load(cache_file, key) if cfg.resume else None
    hub = current_hub()
    try:
        if entry is not None:
            state.say(f"export: reusing {out_dir} (same model, export options, toolchain and exporter code)")
            result = _result_from_cache(entry["result"])
            if entry["checks_key"] == measured_with:
                rows = [StageRow.model_validate(r) for r in entry["rows"]]
                for r in rows:
                    r.details["export_cache"] = "reused artifact and measurements"
            else:
                rows = _verify_export(state, model, exporter, result, label)
                for r in rows:
                    r.details["export_cache"] = "reused artifact, re-measured (checks changed)"
        else:
            export_cache.invalidate(cache_file)
            state.say(f"exporting to {profile.name} ({profile.backend}) in {out_dir}")
            meter = PeakMemory(cpu).start()
            hub.begin(label, "export", message=f"exporting to {profile.name} ({profile.backend})")
            result = exporter.export(model, state.tokenizer, out_dir, options, calibration=state.calibration,
                                     log=state.say, **extra)
            hub.end(label, "export", message=str(result.artifact))
            exported = meter.stop()
            export_s = time.perf_counter() - t0
            rows = _verify_export(state, model, exporter, result, label)
            rows[0].wall_s += export_s  # the main row carries the export itself
            rows[0].resources = exported.merged(rows[0].resources)  # the larger peak: export or verification
            rows[0].details["export_s"] = round(export_s, 2)
            export_cache.save(cache_file, key, measured_with, _result_files(result), _result_to_cache(result),
                              [r.model_dump(mode="json") for r in rows])
    except Exception as exc:
        row = StageRow(index=len(cfg.stages), name=label, kind=label, runtime=profile.exporter)
        record_error(report, row, exc, t0, state.say)
        return
    gates = cfg.gates.merged_with(_budget_gates(profile))
    ok = True
    resumed = entry is not None and entry["checks_key"] == measured_with
    device = _load_device(cfg, report)
    for row in rows:
        wall = row.wall_s
        # with a device profile its memory gate says why an unmeasured peak cannot pass; without one,
        # a memory check that could not measure fails on its own instead of passing silently
        extra = _device_gates_or_error(state, device, model, row) if device is not None else _memory_gate(state, row)
        extra = extra + arm64_gates(row.metrics.arm64)
        ok = record_gated(report, row, gates, state.baseline_metrics, t0, state.say, extra) and ok
        row.wall_s = wall
        if resumed:
            row.status = "resumed" if row.status == "pass" else row.status
    if ok:
        report.last_good_artifact = str(result.artifact)


def _result_files(result) -> list[Path]:
    return sorted({Path(f) for f in [result.artifact, *result.files, *result.extra_artifacts.values()]})


def _result_to_cache(result) -> dict:
    return {"artifact": str(result.artifact), "files": [str(f) for f in result.files],
            "details": result.details, "extra_artifacts": {k: str(v) for k, v in result.extra_artifacts.items()},
            "extra_details": result.extra_details}


def _result_from_cache(d: dict):
    return ExportResult(artifact=Path(d["artifact"]), files=[Path(f) for f in d["files"]], details=d["details"],
                        extra_artifacts={k: Path(v) for k, v in d["extra_artifacts"].items()},
                        extra_details=d.get("extra_details", {}))


def _verify_export(state: RunState, model: torch.nn.Module, exporter, result, label: str) -> list[StageRow]:
    """Measure every artifact of an export in its runtime against eager: one row each."""
    index = len(state.cfg.stages)
    rows = []
    arm64_device = (load_device(state.cfg.device_profile)
                    if state.cfg.checks.arm64 is not None and state.cfg.device_profile else None)
    artifacts = [(label, result.artifact, dict(result.details))]
    artifacts += [(f"{label}:{k}", p, dict(result.extra_details.get(k, {}))) for k, p in result.extra_artifacts.items()]
    for name, path, details in artifacts:
        t0 = time.perf_counter()
        meter = PeakMemory(torch.device("cpu")).start()
        current_hub().begin(name, "verify", message=f"measuring {path} in its runtime")
        runner = exporter.load(path)
        row = StageRow(index=index, name=name, kind=label, runtime=runner.runtime, artifact=str(path), details=details)
        try:
            row.metrics = measure_runner(state, model, runner, row.details)
            score_row_tasks(state, row, model, runner)
            facts = (runner.size_bytes(), runner.max_seq_len)
        finally:
            runner.close()
            current_hub().end(name, "verify")
        if state.cfg.checks.memory:
            row.metrics.memory = _measure_memory(state, model, exporter, path, row, *facts)
        if state.cfg.checks.arm64 is not None:
            row.metrics.arm64 = measure_arm64(state.cfg.checks.arm64, Path(path), state.prompt, state.eval_windows,
                                              facts[1], arm64_device, state.say)
        row.wall_s = time.perf_counter() - t0
        row.resources = meter.stop()
        rows.append(row)
    return rows


def _tied(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return bool(getattr(cfg, "tie_word_embeddings", False))


def _measure_memory(state: RunState, model: torch.nn.Module, exporter, path: Path, row: StageRow,
                    artifact_bytes: int | None, max_seq_len: int | None):
    """The row's memory: artifact and KV-cache bytes, and the peak RSS of a child process that loads
    the artifact and runs a prefill of the cache's length plus decode steps (optimize/footprint/memory.py)."""
    cfg, profile = state.cfg, state.profile
    options = export_options(cfg, profile.exporter, profile)
    dtype = str(getattr(options, "dtype", "float32") or "float32").removeprefix("torch.")
    packed = (packed_copy_bytes(artifact_bytes, model.config, row.details, row.runtime, _tied(model))
              if artifact_bytes else None)
    state.say(f"{row.name}: measuring peak memory in a child process (load, prefill, decode)")
    try:
        fp = footprint(path, exporter, model.config, artifact_bytes=artifact_bytes,
                       max_seq_len=max_seq_len or profile.max_seq_len,
                       kv_dtype=dtype if dtype in ("float32", "float16", "bfloat16") else "float32",
                       packed_bytes=packed, threads=cfg.checks.latency.threads)
    except Exception as exc:  # a measurement that cannot run is recorded, never the export's failure
        fp = MemoryFootprint(artifact_bytes=artifact_bytes, error=f"{type(exc).__name__}: {exc}")
    if fp.error:
        state.say(f"{row.name}: peak memory not measured: {fp.error}")
    return fp


def _memory_gate(state: RunState, row: StageRow) -> list[GateResult]:
    """A failed ``memory`` gate where ``checks.memory`` asked for the peak and the child could not
    measure it (a full-context prefill that asked for more memory than the machine has, a child that
    crashed or ran out of time): the report must not end "all gates passed" without the figure."""
    mem = row.metrics.memory
    if not state.cfg.checks.memory or (mem is not None and mem.error is None):
        return []
    why = mem.error if mem is not None else "no figures"
    return [GateResult(metric="memory", goal={"measured": True}, value=None, baseline=None, ok=False,
                       message=f"peak memory was not measured ({why}); checks.memory: false skips the check")]


def _load_device(cfg: PipelineConfigBase, report: Report):
    """The run's device profile (None without one), recorded in the report."""
    if cfg.device_profile is None:
        return None
    device = load_device(cfg.device_profile)
    report.device_profile = device.model_dump(mode="json")
    return device


def _device_gates_or_error(state: RunState, device, model: torch.nn.Module, row: StageRow) -> list:
    """:func:`_device_gates`, or one failed gate naming why the device check could not run."""
    try:
        return _device_gates(state, device, model, row)
    except Exception as exc:
        log.info("device check of %s failed", row.name, exc_info=exc)
        return [GateResult(metric="device", goal={"device_profile": device.name}, value=None, baseline=None, ok=False,
                           message=f"the check against {device.name} could not run: {type(exc).__name__}: {exc}")]


def _device_gates(state: RunState, device, model: torch.nn.Module, row: StageRow) -> list:
    """The row on the device: memory and storage fit (measured figures) and the PREDICTED decode rate,
    into ``row.metrics.device``; returns the device's gate results."""
    m, lat = row.metrics, state.cfg.checks.latency
    mem = m.memory
    artifact = mem.artifact_bytes if mem is not None else (int(m.size_mb * 2**20) if m.size_mb else None)
    weights = (weight_bytes_per_token(artifact, model.config, row.details, row.runtime, _tied(model))
               if artifact else None)
    context = (m.prefill_tokens + (m.decode_tokens or 0) // 2) if m.prefill_tokens else None
    bw = host_bandwidth(lat.threads) if m.decode_tok_s else None
    p = predict(device, memory=mem, host_decode_tok_s=m.decode_tok_s, host_bandwidth=bw, context_tokens=context,
                weight_bytes=weights, config=model.config,
                max_seq_len=(mem.max_seq_len if mem is not None else None) or state.profile.max_seq_len,
                weight_bytes_by_scheme=bytes_by_scheme(model.config, row.details))
    m.device = p
    rate = f"{p.predicted_decode_tok_s:.1f} tok/s PREDICTED" if p.predicted_decode_tok_s else "decode not predicted"
    fit = ("fits" if p.fits_memory else "does NOT fit") if p.fits_memory is not None else "memory not measured"
    state.say(f"{row.name} on {device.name}: {fit} in {device.memory.usable_gib:g} GiB usable; {rate}")
    return device_gates(p, mem, device.budgets.decode_tok_s)


def _budget_gates(profile) -> GatesConfig | None:
    b = profile.budgets
    goals = {}
    if b.size_mb is not None:
        goals["size_mb"] = MetricGoal(threshold=b.size_mb)
    if b.prefill_ms is not None:
        goals["prefill_ms"] = MetricGoal(threshold=b.prefill_ms)
    if b.decode_tok_s is not None:
        goals["decode_tok_s"] = MetricGoal(threshold=b.decode_tok_s)
    return GatesConfig(**goals) if goals else None
