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
import copy
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from optimize import checkpoints as ckpt
from optimize.checks.accuracy import BaselineLogits, eval_windows
from optimize.config import PipelineConfigBase, dump_config, load_config
from optimize.config_checks import model_problems
from optimize.device import DTYPES, floating_dtype, place, resolve_device
from optimize.draft_rows import draft_digest, run_draft
from optimize.errors import ConfigError
from optimize.export_rows import export_rows
from optimize.measure import RunState, measure_baseline, score_row_tasks
from optimize.progress import Callback, Progress, current_hub, reset_hub, use_hub
from optimize.quiet import LogOutput
from optimize.report import Report, StageRow, write_report
from optimize.resources import PeakMemory
from optimize.stage_api import get_stage
from optimize.stage_rows import run_stages
from optimize.tracking import PipelineTracker
from targets import load_target
from targets.sources.corpus import split_data, windows
from targets.sources import load_model

log = logging.getLogger("optimize")

LOG_NAME = "pipeline.log"


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
    with contextlib.ExitStack() as stack:
        quiet = None
        if not progress:
            fd, pending = tempfile.mkstemp(prefix="optimize-pipeline-", suffix=".log")
            os.close(fd)
            quiet = stack.enter_context(LogOutput(pending))
            stack.callback(lambda: Path(pending).unlink(missing_ok=True))  # a run that never got its directory
        cfg = _resolved(config, target, overrides, device_profile)
        return _run_pipeline(cfg, output_dir, say, progress, callback, quiet, stack)


def _resolved(config: PipelineConfigBase | str | Path, target: str | None, overrides: tuple[str, ...],
              device_profile: str | None) -> PipelineConfigBase:
    """The run's config, loaded here and only here: a YAML path with ``overrides``, or a validated
    config as it is; ``target`` and ``device_profile`` replace the config's where given."""
    if not isinstance(config, PipelineConfigBase):
        return load_config(config, overrides, target=target, device_profile=device_profile)
    if overrides:
        raise TypeError("run_pipeline: overrides apply to a YAML path; pass them to load_config with a config")
    changes = {k: v for k, v in (("target", target), ("device_profile", device_profile))
               if v is not None and v != getattr(config, k)}
    return load_config(dump_config(config) | changes) if changes else config


def _run_pipeline(cfg: PipelineConfigBase, output_dir, say, progress: bool, callback, quiet, stack) -> Report:
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

    stack.callback(reset_hub, use_hub(hub))
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
    current_hub().begin("baseline", message="measuring the model as loaded")
    base_row.metrics, cached = measure_baseline(state, model)
    if cached:
        base_row.details["baseline_cache"] = cached
    score_row_tasks(state, base_row, model)
    base_row.wall_s = time.perf_counter() - t0
    base_row.resources = meter.stop()
    current_hub().end("baseline")
    state.baseline_metrics = base_row.metrics
    report.rows.append(base_row)
    report.last_good_artifact = str(loaded.local_dir) if loaded.local_dir else None
    # a teacher copy only for the stages that read one (and for a draft, which starts from it):
    # a 1B model in 24 GiB cannot hold two
    teachers = any(get_stage(s.kind).uses_baseline for s in cfg.stages)
    baseline_model = copy.deepcopy(model) if teachers or cfg.draft is not None else None

    # ---- stages (resume from the longest finished prefix; optimize/stage_rows.py)
    model = run_stages(state, report, model, config_dump=config_dump, baseline_model=baseline_model if teachers else None,
                       device=device, dtype=dtype, progress=progress)
    if model is None:
        return
    draft = None
    if cfg.draft is not None:  # ---- the draft model, from the model as loaded (optimize/draft_rows.py)
        draft = run_draft(state, report, baseline_model, config_dump=config_dump, device=device, dtype=dtype,
                          progress=progress)
        if draft is None:
            return
    del baseline_model

    if profile is not None:
        state.model_digest = ckpt.prefix_hash(config_dump, len(cfg.stages) - 1)
        if draft is not None:
            state.model_digest += "+draft-" + draft_digest(config_dump)
        cpu = torch.device("cpu")
        # exporters trace and lower on the CPU, in the dtype the model was loaded in
        export_rows(state, place(model, cpu, loaded_dtype), report,
                    draft=place(draft, cpu, loaded_dtype) if draft is not None else None)


def _device_facts(device: torch.device, dtype: torch.dtype) -> dict:
    facts = {"device": str(device), "compute_dtype": str(dtype).removeprefix("torch.")}
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def _calib_windows(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    return windows(ids, seq_len) if ids.numel() >= 2 else []


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
