"""The pipeline runner: baseline → stages (each checked and gated) → export (verified in its
runtime) → report. Stages only transform; everything else happens here, where the model lives
included: it is placed on the run's ``device`` in its ``compute_dtype`` before the baseline
(:func:`optimize.device.place`), stays there through the stages and their checks, and goes back
to the CPU, in the dtype it was loaded in, for the export. Every row records its wall time and
peak memory (:mod:`optimize.resources`).

``run_pipeline`` never loses work: each finished stage is checkpointed (see
:mod:`optimize.checkpoints`), a failed gate or a crash in a stage stops the run with the
last good model kept and the report written, and a re-run resumes after the last finished
stage.
"""

from __future__ import annotations

import copy
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from optimize import checkpoints as ckpt
from optimize.checks.accuracy import eval_windows
from optimize.config import PipelineConfigBase, dump_config, export_options, load_config, model_problems
from optimize.device import DTYPES, floating_dtype, place, resolve_device
from optimize.errors import ConfigError
from optimize.gates import evaluate_gates
from optimize.gates_config import GatesConfig, MetricGoal
from optimize.measure import RunState, measure_eager, measure_runner
from optimize.report import Metrics, Report, StageRow, write_report
from optimize.resources import PeakMemory
from optimize.stage_api import StageContext, get_stage

log = logging.getLogger("optimize")

def run_pipeline(
    config: PipelineConfigBase | str | Path,
    *,
    target: str | None = None,
    overrides: tuple[str, ...] = (),
    output_dir: str | Path | None = None,
    say: Callable[[str], None] | None = None,
) -> Report:
    """Run a pipeline and return its typed report (also written to ``<run>/report.*``).

    ``config`` is a validated config or a YAML path; ``target`` overrides the config's
    target. The report's ``ok`` is False when a gate with ``on_fail: stop`` failed or a
    stage raised; the CLI turns that into a non-zero exit code.
    """
    if not isinstance(config, PipelineConfigBase):
        config = load_config(config, overrides, target=target)
    elif target is not None and target != config.target:
        config = load_config(dump_config(config) | {"target": target})
    cfg = config
    say = say or (lambda msg: print(msg, file=sys.stderr))
    run_dir = Path(output_dir) if output_dir else cfg.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = Report(name=cfg.name, target=cfg.target, config=dump_config(cfg), environment=environment(),
                    output_dir=str(run_dir))
    try:
        _run(cfg, run_dir, report, say)
    finally:
        report.wall_s = time.perf_counter() - started
        paths = write_report(report, run_dir)
        say(f"report: {paths['md']}")
    return report


def _run(cfg: PipelineConfigBase, run_dir: Path, report: Report, say) -> None:
    from targets import load_target
    from train.corpus import load_text, split_corpus, tokenize
    from train.sources import load_model

    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device, cfg.name)  # device: cuda without CUDA is refused before anything loads
    profile = load_target(cfg.target) if cfg.target else None
    config_dump = dump_config(cfg)

    say(f"loading model ({cfg.model.source})")
    loaded = load_model(cfg.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    # pre-flight on the loaded model's own config: refuse before the first stage, not after it
    problems = model_problems(cfg, model.config)
    if problems:
        raise ConfigError(cfg.name, problems)
    loaded_dtype = floating_dtype(model)  # what the exporter gets back
    dtype = DTYPES[cfg.compute_dtype] if cfg.compute_dtype else loaded_dtype
    model = place(model, device, dtype)
    report.environment.update(_device_facts(device, dtype))
    if device.type != "cpu" or dtype != loaded_dtype:
        say(f"stages and checks run on {device} in {str(dtype).removeprefix('torch.')}")

    ids = tokenize(load_text(cfg.data.corpus), tokenizer)
    splits = split_corpus(ids, eval_tokens=cfg.data.eval_tokens, calib_tokens=cfg.data.calibration_tokens,
                          corpus=cfg.data.corpus)
    report.data = splits.describe()
    seq_len = cfg.data.seq_len
    if profile is not None and seq_len > profile.max_seq_len:
        say(f"data.seq_len {seq_len} exceeds target max_seq_len {profile.max_seq_len}; using {profile.max_seq_len}")
        seq_len = profile.max_seq_len
    lat = cfg.checks.latency
    state = RunState(
        cfg=cfg, run_dir=run_dir, profile=profile, tokenizer=tokenizer,
        eval_windows=eval_windows(splits.eval_ids, seq_len),
        calibration=[w for w in _calib_windows(splits.calib_ids, seq_len)],
        train_ids=splits.train_ids,
        prompt=splits.train_ids[: lat.prompt_tokens] if splits.train_ids.numel() >= lat.prompt_tokens else splits.eval_ids[: lat.prompt_tokens],
        say=say,
    )

    # ---- baseline
    t0 = time.perf_counter()
    meter = PeakMemory(device).start()
    base_row = StageRow(index=-1, name="baseline", kind="baseline", details={"source": loaded.description})
    base_row.metrics = measure_eager(state, model, keep_baseline=True, timed=True)
    base_row.wall_s = time.perf_counter() - t0
    base_row.resources = meter.stop()
    state.baseline_metrics = base_row.metrics
    report.rows.append(base_row)
    report.last_good_artifact = str(loaded.local_dir) if loaded.local_dir else None
    # a teacher copy only for the stages that read one: a 1B model in 24 GiB cannot hold two
    teachers = any(get_stage(s.kind).uses_baseline for s in cfg.stages)
    baseline_model = copy.deepcopy(model) if teachers else None

    # ---- stages (resume from the longest finished prefix)
    digests = [ckpt.prefix_hash(config_dump, i) for i in range(len(cfg.stages))]
    dirs = [ckpt.stage_dir(run_dir, i, s.kind, d) for i, (s, d) in enumerate(zip(cfg.stages, digests))]
    done = 0
    if cfg.resume:
        while done < len(dirs) and ckpt.is_complete(dirs[done]):
            done += 1
    if done:
        restores = _restores(cfg, done)
        model, _ = ckpt.load_stage(dirs[done - 1], restores)
        model = place(model, device, dtype)
        for i in range(done):
            row = StageRow.model_validate(ckpt.load_stage_row(dirs[i]))
            row.status = "resumed" if row.status == "pass" else row.status
            report.rows.append(row)
        report.last_good_artifact = str(dirs[done - 1])
        state.quantized = any(s.quant_scheme() for s in cfg.stages[:done])
        say(f"resuming: stage{'s' if done > 1 else ''} 0..{done - 1} finished in an earlier run "
            f"({dirs[done - 1].name}); starting at stage {done}" if done < len(dirs) else
            f"resuming: all {done} stages finished in an earlier run")

    bar = tqdm(total=len(cfg.stages), initial=done, desc="stages", unit="stage", file=sys.stderr)
    for i in range(done, len(cfg.stages)):
        stage_cfg = cfg.stages[i]
        spec = get_stage(stage_cfg.kind)
        label = stage_cfg.label(i)
        bar.set_postfix_str(label)
        say(f"stage {label}: {spec.description}")
        row = StageRow(index=i, name=label, kind=stage_cfg.kind)
        t0 = time.perf_counter()
        meter = PeakMemory(device).start()
        ctx = StageContext(tokenizer=tokenizer, calibration=state.calibration, train_ids=state.train_ids,
                           target=profile, work_dir=run_dir / "work" / f"{i:02d}-{stage_cfg.kind}", seed=cfg.seed,
                           baseline_model=baseline_model, log=say, device=device, dtype=dtype)
        ctx.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            torch.manual_seed(cfg.seed + i + 1)
            model = spec.fn(model, stage_cfg, ctx)
            if model is None:
                raise RuntimeError(f"stage {stage_cfg.kind!r} returned None instead of the model")
            model = place(model, device, dtype)  # a stage that built new modules may have left them elsewhere
            model.eval()
            state.quantized = state.quantized or stage_cfg.quant_scheme() is not None
            row.details = ctx.details
            row.metrics = measure_eager(state, model, timed=not state.quantized or state.profile is None
                                         or cfg.checks.latency.eager_quantized)
        except Exception as exc:  # a broken stage stops the run; earlier work is kept
            row.resources = meter.stop()
            _record_error(report, row, exc, t0, say)
            bar.close()
            return
        row.resources = meter.stop()
        if not _record_gated(report, row, cfg.gates.merged_with(stage_cfg.gates), state.baseline_metrics, t0, say):
            bar.close()
            return
        row.artifact = str(dirs[i])
        ckpt.save_stage(dirs[i], model, row.model_dump(mode="json"), stage_cfg.model_dump(mode="json"))
        report.last_good_artifact = str(dirs[i])
        bar.update(1)
    bar.close()

    if profile is not None:
        state.model_digest = ckpt.prefix_hash(config_dump, len(cfg.stages) - 1)
        # exporters trace and lower on the CPU, in the dtype the model was loaded in
        _export(state, place(model, torch.device("cpu"), loaded_dtype), report)


def _device_facts(device: torch.device, dtype: torch.dtype) -> dict:
    facts = {"device": str(device), "compute_dtype": str(dtype).removeprefix("torch.")}
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def _calib_windows(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    from train.corpus import windows

    return windows(ids, seq_len) if ids.numel() >= 2 else []


def _restores(cfg: PipelineConfigBase, upto: int) -> list[Callable[[torch.nn.Module], None]]:
    out = []
    for stage_cfg in cfg.stages[:upto]:
        spec = get_stage(stage_cfg.kind)
        if spec.restore is not None:
            out.append(lambda m, s=spec, c=stage_cfg: s.restore(m, c))
    return out


def _record_error(report: Report, row: StageRow, exc: Exception, t0: float, say) -> None:
    """A stage or export raised: record it, stop the run, keep the last good model."""
    row.status, row.error = "error", f"{type(exc).__name__}: {exc}"
    row.wall_s = time.perf_counter() - t0
    report.rows.append(row)
    report.ok, report.stopped_at = False, row.name
    # one clear line for the user; the traceback only with -v (INFO), it is in no report
    log.info("%s failed", row.name, exc_info=exc)
    say(f"{row.name} failed: {row.error}; last good model kept at {report.last_good_artifact}")


def _record_gated(report: Report, row: StageRow, gates: GatesConfig, baseline: Metrics, t0: float, say) -> bool:
    """Evaluate the row's gates and append it; False when a failed gate stops the run."""
    row.gates = evaluate_gates(gates, row.metrics, baseline)
    row.status = _status(row.gates, gates)
    row.wall_s = time.perf_counter() - t0
    report.rows.append(row)
    if row.status != "fail":
        return True
    report.ok, report.stopped_at = False, report.stopped_at or row.name
    say(f"{row.name} failed its gates: " + "; ".join(g.message for g in row.gates if not g.ok))
    return False


def _status(results, gates: GatesConfig) -> str:
    if all(g.ok for g in results):
        return "pass"
    return "warn" if gates.on_fail == "warn" else "fail"


def _export(state: RunState, model: torch.nn.Module, report: Report) -> None:
    """Export (or reuse a cached export of) the final model; one gated row per artifact."""
    from export.base import get_exporter
    from optimize import export_cache

    cfg, profile = state.cfg, state.profile
    exporter = get_exporter(profile.exporter)
    options = export_options(cfg, profile.exporter, profile)
    out_dir = state.run_dir / "export" / profile.name
    label = f"export:{profile.name}"
    t0 = time.perf_counter()
    cpu = torch.device("cpu")
    cache_file = export_cache.cache_path(state.run_dir, profile.name)
    key = export_cache.export_key(state.model_digest, profile, options)
    checks_key = _checks_key(cfg)
    entry = export_cache.load(cache_file, key) if cfg.resume else None
    try:
        if entry is not None:
            state.say(f"export: reusing {out_dir} (same model, export options, toolchain and exporter code)")
            result = _result_from_cache(entry["result"])
            if entry["checks_key"] == checks_key:
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
            result = exporter.export(model, state.tokenizer, out_dir, options, calibration=state.calibration,
                                     log=state.say)
            exported = meter.stop()
            export_s = time.perf_counter() - t0
            rows = _verify_export(state, model, exporter, result, label)
            rows[0].wall_s += export_s  # the main row carries the export itself
            rows[0].resources = exported.merged(rows[0].resources)  # the larger peak: export or verification
            rows[0].details["export_s"] = round(export_s, 2)
            export_cache.save(cache_file, key, checks_key, _result_files(result), _result_to_cache(result),
                              [r.model_dump(mode="json") for r in rows])
    except Exception as exc:
        row = StageRow(index=len(cfg.stages), name=label, kind=label, runtime=profile.exporter)
        _record_error(report, row, exc, t0, state.say)
        return
    gates = cfg.gates.merged_with(_budget_gates(profile))
    ok = True
    resumed = entry is not None and entry["checks_key"] == checks_key
    for row in rows:
        wall = row.wall_s
        ok = _record_gated(report, row, gates, state.baseline_metrics, t0, state.say) and ok
        row.wall_s = wall
        if resumed:
            row.status = "resumed" if row.status == "pass" else row.status
    if ok:
        report.last_good_artifact = str(result.artifact)


def _checks_key(cfg: PipelineConfigBase) -> str:
    """What the export rows' measurements depend on besides the artifact."""
    import hashlib
    import json

    key = {"checks": cfg.checks.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _result_files(result) -> list[Path]:
    return sorted({Path(f) for f in [result.artifact, *result.files, *result.extra_artifacts.values()]})


def _result_to_cache(result) -> dict:
    return {"artifact": str(result.artifact), "files": [str(f) for f in result.files],
            "details": result.details, "extra_artifacts": {k: str(v) for k, v in result.extra_artifacts.items()},
            "extra_details": result.extra_details}


def _result_from_cache(d: dict):
    from export.base import ExportResult

    return ExportResult(artifact=Path(d["artifact"]), files=[Path(f) for f in d["files"]], details=d["details"],
                        extra_artifacts={k: Path(v) for k, v in d["extra_artifacts"].items()},
                        extra_details=d.get("extra_details", {}))


def _verify_export(state: RunState, model: torch.nn.Module, exporter, result, label: str) -> list[StageRow]:
    """Measure every artifact of an export in its runtime against eager: one row each."""
    index = len(state.cfg.stages)
    rows = []
    artifacts = [(label, result.artifact, dict(result.details))]
    artifacts += [(f"{label}:{k}", p, dict(result.extra_details.get(k, {}))) for k, p in result.extra_artifacts.items()]
    for name, path, details in artifacts:
        t0 = time.perf_counter()
        meter = PeakMemory(torch.device("cpu")).start()
        runner = exporter.load(path)
        row = StageRow(index=index, name=name, kind=label, runtime=runner.runtime, artifact=str(path), details=details)
        try:
            row.metrics = measure_runner(state, model, runner, row.details)
        finally:
            runner.close()
        row.wall_s = time.perf_counter() - t0
        row.resources = meter.stop()
        rows.append(row)
    return rows


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


def environment() -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "torchao", "executorch", "onnx", "onnxruntime", "peft"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "torch_threads": torch.get_num_threads(), "versions": versions}
