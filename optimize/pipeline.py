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

import contextlib
import contextvars
import copy
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from optimize import checkpoints as ckpt
from optimize.checks.accuracy import BaselineLogits, eval_windows
from optimize.config import PipelineConfigBase, dump_config, export_options, load_config, model_problems
from optimize.device import DTYPES, floating_dtype, place, resolve_device
from optimize.errors import ConfigError
from optimize.gates import evaluate_gates
from optimize.gates_config import GatesConfig, MetricGoal
from optimize.measure import RunState, measure_baseline, measure_eager, measure_runner, score_tasks
from optimize.progress import Callback, Progress
from optimize.report import Metrics, Report, StageRow, write_report
from optimize.resources import PeakMemory, release_free_heap
from optimize.stage_api import StageContext, get_stage, restorers

log = logging.getLogger("optimize")

#: the run's progress hub, for the parts of the runner that report phases (_export)
_PROGRESS: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("optimize_progress", default=None)

LOG_NAME = "pipeline.log"


def _hub() -> Progress:
    return _PROGRESS.get() or Progress()


def run_pipeline(
    config: PipelineConfigBase | str | Path,
    *,
    target: str | None = None,
    overrides: tuple[str, ...] = (),
    output_dir: str | Path | None = None,
    say: Callable[[str], None] | None = None,
    progress: bool = False,
    callback: Callback | None = None,
    device_profile: str | None = None,
) -> Report:
    """Run a pipeline and return its typed report (also written to ``<run>/report.*``).

    ``config`` is a validated config or a YAML path; ``target`` overrides the config's
    target. The report's ``ok`` is False when a gate with ``on_fail: stop`` failed or a
    stage raised; the CLI turns that into a non-zero exit code.

    The API is quiet unless asked: with ``progress=False`` (the default) the run writes nothing
    to the process's stdout and stderr, file descriptors included (library warnings, bars,
    native runtimes' prints); all of it goes to ``<run>/pipeline.log`` (:mod:`optimize.quiet`).
    ``progress=True`` prints the run's messages and draws tqdm bars on stderr (what the CLI does
    on a terminal). Either way the messages are in ``pipeline.log`` and, if given, passed to
    ``say``; ``callback`` receives every :class:`~optimize.progress.ProgressEvent` (stage
    begin/end, training steps with loss, tokens/s and ETA, export phases). ``device_profile`` (a
    name from ``optimize ls devices`` or a YAML path) replaces the config's: the export rows are
    checked against that device (docs/devices.md).
    """
    from optimize.quiet import LogOutput

    if device_profile is not None:
        if isinstance(config, PipelineConfigBase):
            config = load_config(dump_config(config) | {"device_profile": device_profile})
        else:
            config = load_config(config, overrides, target=target, device_profile=device_profile)
            target, overrides = None, ()

    with contextlib.ExitStack() as stack:
        quiet = None
        if not progress:
            fd, pending = tempfile.mkstemp(prefix="optimize-pipeline-", suffix=".log")
            os.close(fd)
            quiet = stack.enter_context(LogOutput(pending))
            stack.callback(lambda: Path(pending).unlink(missing_ok=True))  # a run that never got its directory
        return _run_pipeline(config, target, overrides, output_dir, say, progress, callback, quiet, stack)


def _run_pipeline(config, target, overrides, output_dir, say, progress: bool, callback, quiet, stack) -> Report:
    from optimize.tracking import PipelineTracker

    if not isinstance(config, PipelineConfigBase):
        config = load_config(config, overrides, target=target)
    elif target is not None and target != config.target:
        config = load_config(dump_config(config) | {"target": target})
    cfg = config
    run_dir = Path(output_dir) if output_dir else cfg.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / LOG_NAME
    hub = Progress(bars=progress, callback=callback)
    stack.callback(hub.close)
    if quiet is not None:
        quiet.move_to(log_path)
        write_log = quiet.write
    else:
        log_file = stack.enter_context(open(log_path, "a", buffering=1, encoding="utf-8"))
        write_log = lambda msg: log_file.write(msg + "\n")  # noqa: E731
    write_log(f"== {cfg.name}: run started {time.strftime('%Y-%m-%d %H:%M:%S')} in {run_dir}")
    user_say = say

    def say(msg: str) -> None:
        write_log(msg)
        if user_say is not None:
            user_say(msg)
        elif progress:
            hub.write(msg)

    token = _PROGRESS.set(hub)
    stack.callback(_PROGRESS.reset, token)
    started = time.perf_counter()
    report = Report(name=cfg.name, target=cfg.target, config=dump_config(cfg), environment=environment(),
                    output_dir=str(run_dir))
    tracker = PipelineTracker.start(cfg, run_dir, say)
    if tracker is not None:
        hub.listeners.append(tracker.on_progress)
    status = "FAILED"
    # the baseline's log-probabilities, on disk for the run (optimize.checks.accuracy.BaselineLogits)
    spill = Path(tempfile.mkdtemp(prefix="baseline-logprobs-", dir=run_dir))
    stack.callback(shutil.rmtree, spill, ignore_errors=True)
    try:
        _run(cfg, run_dir, report, say, progress, baseline_dir=spill)
        status = "FINISHED" if report.ok else "FAILED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        report.wall_s = time.perf_counter() - started
        paths = write_report(report, run_dir)
        say(f"report: {paths['md']}")
        if tracker is not None:
            if quiet is not None and quiet.file is not None:
                quiet.file.flush()
            tracker.finish(report, paths, status, log_path)
    return report


def _run(cfg: PipelineConfigBase, run_dir: Path, report: Report, say, progress: bool = False,
         baseline_dir: Path | None = None) -> None:
    """The run itself; ``baseline_dir`` (None: in memory) holds the baseline's log-probabilities,
    which the agreement and KL checks read one window at a time: kept in memory they are
    positions x vocab fp16 for the whole run (1 GB for a 128256-token vocabulary at 4096 eval
    tokens, a third of a bf16 1B model, which set the floor of a CPU run's peak RSS)."""
    from targets import load_target
    from train.corpus import split_data
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

    splits = split_data(cfg.data, tokenizer)
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
        baseline_logits=BaselineLogits(directory=baseline_dir),
    )

    # ---- baseline
    t0 = time.perf_counter()
    meter = PeakMemory(device).start()
    base_row = StageRow(index=-1, name="baseline", kind="baseline", details={"source": loaded.description})
    _hub().begin("baseline", message="measuring the model as loaded")
    base_row.metrics, cached = measure_baseline(state, model)
    if cached:
        base_row.details["baseline_cache"] = cached
    _score_tasks(state, base_row, model)
    base_row.wall_s = time.perf_counter() - t0
    base_row.resources = meter.stop()
    _hub().end("baseline")
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
    cache = _stage_cache(state, config_dump, model, device, dtype) if cfg.stage_cache else None
    if done:
        restores = restorers(cfg.stages[:done])
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

    hub = _hub()
    bar = tqdm(total=len(cfg.stages), initial=done, desc="stages", unit="stage", file=sys.stderr, disable=not progress)
    for i in range(done, len(cfg.stages)):
        stage_cfg = cfg.stages[i]
        # with the stage cache, one process computes a stage while another that needs it waits, then reuses it
        with cache.claim(i) if cache is not None else contextlib.nullcontext():
            reused = _load_cached_stage(state, cache, dirs[i], i) if cache is not None else None
            if reused is not None:
                model = place(reused, device, dtype)
                if not _reuse_cached_stage(state, report, model, dirs[i], i, cache.checks_key):
                    bar.close()
                    return
                bar.update(1)
                continue
            spec = get_stage(stage_cfg.kind)
            label = stage_cfg.label(i)
            bar.set_postfix_str(label)
            say(f"stage {label}: {spec.description}")
            row = StageRow(index=i, name=label, kind=stage_cfg.kind)
            t0 = time.perf_counter()
            release_free_heap()  # what the last row's checks freed: the row starts from what is in use
            meter = PeakMemory(device).start()
            ctx = StageContext(tokenizer=tokenizer, calibration=state.calibration, train_ids=state.train_ids,
                               target=profile, work_dir=run_dir / "work" / f"{i:02d}-{stage_cfg.kind}", seed=cfg.seed,
                               baseline_model=baseline_model, log=say, device=device, dtype=dtype,
                               on_progress=hub.for_stage(label), cache_dir=cache.root.parent if cache else None)
            ctx.work_dir.mkdir(parents=True, exist_ok=True)
            hub.begin(label, message=spec.description)
            try:
                torch.manual_seed(cfg.seed + i + 1)
                model = spec.fn(model, stage_cfg, ctx)
                if model is None:
                    raise RuntimeError(f"stage {stage_cfg.kind!r} returned None instead of the model")
                release_free_heap()  # what the stage freed, before the checks' logits are allocated
                model = place(model, device, dtype)  # a stage that built new modules may have left them elsewhere
                model.eval()
                state.quantized = state.quantized or stage_cfg.quant_scheme() is not None
                row.details = ctx.details
                row.metrics = measure_eager(state, model, timed=_timed_eager(state))
                _score_tasks(state, row, model)
            except Exception as exc:  # a broken stage stops the run; earlier work is kept
                row.resources = meter.stop()
                hub.end(label, message=f"error: {type(exc).__name__}")
                _record_error(report, row, exc, t0, say)
                bar.close()
                return
            row.resources = meter.stop()
            hub.end(label)
            if not _record_gated(report, row, cfg.gates.merged_with(stage_cfg.gates), state.baseline_metrics, t0, say):
                bar.close()
                return
            row.artifact = str(dirs[i])
            ckpt.save_stage(dirs[i], model, row.model_dump(mode="json"), stage_cfg.model_dump(mode="json"))
            if cache is not None:
                cache.store(i, dirs[i], row.wall_s)
            report.last_good_artifact = str(dirs[i])
        bar.update(1)
    bar.close()

    if profile is not None:
        state.model_digest = ckpt.prefix_hash(config_dump, len(cfg.stages) - 1)
        # exporters trace and lower on the CPU, in the dtype the model was loaded in
        _export(state, place(model, torch.device("cpu"), loaded_dtype), report)


def _timed_eager(state: RunState) -> bool:
    """Whether an eager row's latency is measured (eager torchao kernels are slow on a CPU: a
    quantized model headed for an export is timed in its runtime unless the config asks)."""
    return not state.quantized or state.profile is None or state.cfg.checks.latency.eager_quantized


def _stage_cache(state: RunState, config_dump: dict, model: torch.nn.Module, device, dtype):
    """The run's :class:`~optimize.stage_cache.StageCache` (``stage_cache: true``), keyed by the model as loaded."""
    from optimize.stage_cache import StageCache

    cache = StageCache.for_run(config_dump, len(state.cfg.stages), model, calibration=state.calibration,
                               train_ids=state.train_ids, profile=state.profile, device=device, dtype=dtype,
                               checks_key=_checks_key(state.cfg))
    if cache is None:
        state.say("stage cache: the model as loaded has tensors without plain bytes to key it by; off for this run")
    return cache


def _load_cached_stage(state: RunState, cache, stage_dir: Path, i: int) -> torch.nn.Module | None:
    """Stage ``i``'s model from the stage cache (linked into ``stage_dir``), or None on a miss; an
    entry that does not load is dropped and the stage computed (a damaged cache is never fatal)."""
    if not cache.fetch(i, stage_dir):
        return None
    try:
        return ckpt.load_stage(stage_dir, restorers(state.cfg.stages[: i + 1]))[0]
    except Exception as exc:  # noqa: BLE001 - a cache entry that does not load is a miss, whatever broke it
        state.say(f"stage cache: {type(exc).__name__}: {exc}; computing the stage instead")
        cache.discard(i)
        shutil.rmtree(stage_dir, ignore_errors=True)
        return None


def _reuse_cached_stage(state: RunState, report: Report, model: torch.nn.Module, stage_dir: Path, i: int,
                        checks_key: str) -> bool:
    """Stage ``i`` as another run computed it (linked into ``stage_dir``): its row, measured again
    where this run's checks differ, gated by this run's gates. False when a gate stops the run."""
    from optimize.stage_cache import CHECKS_FILE, measured_with
    from targets.atomic import atomic_write_json

    cfg = state.cfg
    row = StageRow.model_validate(ckpt.load_stage_row(stage_dir))
    renamed = row.name != cfg.stages[i].label(i)
    row.name = cfg.stages[i].label(i)  # this run's name for the stage (names are not part of the key)
    state.quantized = state.quantized or cfg.stages[i].quant_scheme() is not None
    row.details["stage_cache"] = f"reused from {stage_dir.name} in the stage cache"
    state.say(f"stage {row.name}: reused from the stage cache (the same stages, weights, data and code)")
    wall = row.wall_s
    remeasured = measured_with(stage_dir) != checks_key
    if remeasured:
        state.say(f"{row.name}: measuring the reused model (this run's checks differ from those of the run "
                  "that computed it)")
        row.metrics = measure_eager(state, model, timed=_timed_eager(state))
        _score_tasks(state, row, model)
        row.details["stage_cache"] += ", measured again"
        atomic_write_json(stage_dir / CHECKS_FILE, {"checks_key": checks_key})
    if renamed or remeasured:
        # this run's row for its own resume; replaced, never written through the link, so the cache keeps its own
        atomic_write_json(stage_dir / "row.json", row.model_dump(mode="json"))
    row.artifact = str(stage_dir)
    ok = _record_gated(report, row, cfg.gates.merged_with(cfg.stages[i].gates), state.baseline_metrics,
                       time.perf_counter(), state.say)
    row.wall_s = wall
    if ok:
        row.status = "resumed" if row.status == "pass" else row.status
        report.last_good_artifact = str(stage_dir)
    return ok


def _score_tasks(state: RunState, row: StageRow, model: torch.nn.Module, runner=None) -> None:
    """checks.tasks on this row when it is selected: eager rows through EagerRunner on the model,
    export rows through the artifact's own runner."""
    from export.runtime import EagerRunner

    tasks = state.cfg.checks.tasks
    if not tasks.enabled or not tasks.selects(row.index, row.name, row.kind):
        return
    runner = runner or EagerRunner(model)
    state.say(f"{row.name}: scoring {', '.join(tasks.names)} in {runner.runtime}"
              + (f" (first {tasks.limit} items each)" if tasks.limit else ""))
    row.metrics.tasks = score_tasks(state, runner, row.details, model)
    state.say(f"{row.name}: " + ", ".join(f"{t} {s.metric} {s.score:.1f}" for t, s in row.metrics.tasks.items()
                                          if s.score is not None))


def _device_facts(device: torch.device, dtype: torch.dtype) -> dict:
    facts = {"device": str(device), "compute_dtype": str(dtype).removeprefix("torch.")}
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def _calib_windows(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    from train.corpus import windows

    return windows(ids, seq_len) if ids.numel() >= 2 else []


def _record_error(report: Report, row: StageRow, exc: Exception, t0: float, say) -> None:
    """A stage or export raised: record it, stop the run, keep the last good model."""
    row.status, row.error = "error", f"{type(exc).__name__}: {exc}"
    row.wall_s = time.perf_counter() - t0
    report.rows.append(row)
    report.ok, report.stopped_at = False, row.name
    # one clear line for the user; the traceback only with -v (INFO), it is in no report
    log.info("%s failed", row.name, exc_info=exc)
    say(f"{row.name} failed: {row.error}; last good model kept at {report.last_good_artifact}")


def _record_gated(report: Report, row: StageRow, gates: GatesConfig, baseline: Metrics, t0: float, say,
                  extra=()) -> bool:
    """Evaluate the row's gates (and ``extra`` results, the device's) and append it; False when a
    failed gate stops the run."""
    row.gates = evaluate_gates(gates, row.metrics, baseline) + list(extra)
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
    hub = _hub()
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
            hub.begin(label, "export", message=f"exporting to {profile.name} ({profile.backend})")
            result = exporter.export(model, state.tokenizer, out_dir, options, calibration=state.calibration,
                                     log=state.say)
            hub.end(label, "export", message=str(result.artifact))
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
    device = _load_device(cfg, report)
    for row in rows:
        wall = row.wall_s
        extra = _device_gates_or_error(state, device, model, row) if device is not None else ()
        ok = _record_gated(report, row, gates, state.baseline_metrics, t0, state.say, extra) and ok
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
        _hub().begin(name, "verify", message=f"measuring {path} in its runtime")
        runner = exporter.load(path)
        row = StageRow(index=index, name=name, kind=label, runtime=runner.runtime, artifact=str(path), details=details)
        try:
            row.metrics = measure_runner(state, model, runner, row.details)
            _score_tasks(state, row, model, runner)
            facts = (runner.size_bytes(), runner.max_seq_len)
        finally:
            runner.close()
            _hub().end(name, "verify")
        if state.cfg.checks.memory:
            row.metrics.memory = _measure_memory(state, model, exporter, path, row, *facts)
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
    the artifact and runs a prefill of the cache's length plus decode steps (optimize/memory.py)."""
    from optimize.memory import footprint
    from optimize.predict import packed_copy_bytes

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
        from optimize.memory import MemoryFootprint

        fp = MemoryFootprint(artifact_bytes=artifact_bytes, error=f"{type(exc).__name__}: {exc}")
    if fp.error:
        state.say(f"{row.name}: peak memory not measured: {fp.error}")
    return fp


def _load_device(cfg: PipelineConfigBase, report: Report):
    """The run's device profile (None without one), recorded in the report."""
    if cfg.device_profile is None:
        return None
    from targets.devices import load_device

    device = load_device(cfg.device_profile)
    report.device_profile = device.model_dump(mode="json")
    return device


def _device_gates_or_error(state: RunState, device, model: torch.nn.Module, row: StageRow) -> list:
    """:func:`_device_gates`, or one failed gate naming why the device check could not run."""
    from optimize.gates_config import GateResult

    try:
        return _device_gates(state, device, model, row)
    except Exception as exc:
        log.info("device check of %s failed", row.name, exc_info=exc)
        return [GateResult(metric="device", goal={"device_profile": device.name}, value=None, baseline=None, ok=False,
                           message=f"the check against {device.name} could not run: {type(exc).__name__}: {exc}")]


def _device_gates(state: RunState, device, model: torch.nn.Module, row: StageRow) -> list:
    """The row on the device: memory and storage fit (measured figures) and the PREDICTED decode rate,
    into ``row.metrics.device``; returns the device's gate results."""
    from optimize.predict import bytes_by_scheme, device_gates, predict, weight_bytes_per_token
    from targets.devices import host_bandwidth

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
