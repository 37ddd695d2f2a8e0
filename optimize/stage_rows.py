"""The pipeline's stages: resume from the longest finished prefix, then each remaining stage run,
measured in eager mode, gated and checkpointed (or reused from the stage cache).

Why apart from :mod:`optimize.pipeline`: the runner decides the order of a run (load, baseline,
stages, export, report); this module owns a stage's row from its context to its checkpoint, and
the stage cache's part in it (:mod:`optimize.stage_cache`).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from optimize import checkpoints as ckpt
from optimize.device import place
from optimize.gates_config import GatesConfig
from optimize.measure import RunState, checks_key, measure_eager, score_row_tasks
from optimize.progress import current_hub
from optimize.report import Report, StageRow
from optimize.resources import PeakMemory, release_free_heap
from optimize.rows import record_error, record_gated
from optimize.stage_api import StageContext, get_stage, restorers
from optimize.stage_cache import CHECKS_FILE, StageCache, measured_with
from targets.atomic import atomic_write_json


@dataclass
class StageSeq:
    """Stages run in order from one model, each with its row, gates and checkpoint: the pipeline's own
    (:func:`main_stages`), or the draft block's (:mod:`optimize.draft_rows`)."""

    stages: list
    #: what determines the model after each stage (its checkpoint's key)
    digests: list[str]
    dirs: list[Path]
    #: each stage's row name
    names: list[str]
    #: the gates every row is held to before a stage's own
    gates: GatesConfig
    #: whether the stage cache (``stage_cache: true``) serves these stages
    cacheable: bool = True
    #: what the progress bar calls them
    desc: str = "stages"


def main_stages(state: RunState, config_dump: dict) -> StageSeq:
    """The pipeline's ``stages``, checkpointed under ``<run>/stages``."""
    cfg = state.cfg
    digests = [ckpt.prefix_hash(config_dump, i) for i in range(len(cfg.stages))]
    dirs = [ckpt.stage_dir(state.run_dir, i, s.kind, d) for i, (s, d) in enumerate(zip(cfg.stages, digests))]
    return StageSeq(list(cfg.stages), digests, dirs, [s.label(i) for i, s in enumerate(cfg.stages)], cfg.gates)


def run_stages(state: RunState, report: Report, model: torch.nn.Module, *, config_dump: dict,
               baseline_model: torch.nn.Module | None, device: torch.device, dtype: torch.dtype,
               progress: bool, seq: StageSeq | None = None) -> torch.nn.Module | None:
    """Every stage of ``seq`` (default: the run's ``stages``) in order; the model after the last, or None
    where a stage's error or a gate stopped the run (its row recorded, the last good model named in the
    report)."""
    cfg, say = state.cfg, state.say
    seq = seq if seq is not None else main_stages(state, config_dump)
    stages, dirs = seq.stages, seq.dirs
    done = 0
    if cfg.resume:
        while done < len(dirs) and ckpt.is_complete(dirs[done]):
            done += 1
    cache = (_stage_cache(state, config_dump, model, device, dtype)
             if cfg.stage_cache and seq.cacheable else None)
    if done:
        restores = restorers(stages[:done])
        model, _ = ckpt.load_stage(dirs[done - 1], restores)
        model = place(model, device, dtype)
        for i in range(done):
            row = StageRow.model_validate(ckpt.load_stage_row(dirs[i]))
            row.status = "resumed" if row.status == "pass" else row.status
            report.rows.append(row)
        report.last_good_artifact = str(dirs[done - 1])
        state.quantized = any(s.quant_scheme() for s in stages[:done])
        one = seq.desc.removesuffix("s")  # "stage", "draft stage"
        say(f"resuming: {one if done == 1 else seq.desc} 0..{done - 1} finished in an earlier run "
            f"({dirs[done - 1].name}); starting at {one} {done} ({seq.names[done]})" if done < len(dirs) else
            f"resuming: all {done} {seq.desc} finished in an earlier run")

    hub = current_hub()
    bar = tqdm(total=len(stages), initial=done, desc=seq.desc, unit="stage", file=sys.stderr, disable=not progress)
    try:
        for i in range(done, len(stages)):
            bar.set_postfix_str(seq.names[i])
            # with the stage cache, one process computes a stage while another that needs it waits, then reuses it
            with cache.claim(i) if cache is not None else contextlib.nullcontext():
                reused = _load_cached_stage(state, cache, dirs[i], i) if cache is not None else None
                if reused is not None:
                    model = place(reused, device, dtype)
                    if not _reuse_cached_stage(state, report, model, dirs[i], i, cache.checks_key):
                        return None
                else:
                    model = _compute_stage(state, report, model, seq, i, cache=cache, baseline_model=baseline_model,
                                           device=device, dtype=dtype, hub=hub)
                    if model is None:
                        return None
            bar.update(1)
    finally:
        bar.close()
    return model


def _compute_stage(state: RunState, report: Report, model: torch.nn.Module, seq: StageSeq, i: int, *, cache,
                   baseline_model: torch.nn.Module | None, device: torch.device, dtype: torch.dtype,
                   hub) -> torch.nn.Module | None:
    """Stage ``i`` of ``seq`` run, measured, gated and checkpointed: the model after it, or None where its
    error or a failed gate stops the run."""
    cfg, say = state.cfg, state.say
    stage_cfg, stage_dir = seq.stages[i], seq.dirs[i]
    spec = get_stage(stage_cfg.kind)
    label = seq.names[i]
    say(f"stage {label}: {spec.description}")
    row = StageRow(index=i, name=label, kind=stage_cfg.kind)
    t0 = time.perf_counter()
    release_free_heap()  # what the last row's checks freed: the row starts from what is in use
    meter = PeakMemory(device).start()
    ctx = StageContext(tokenizer=state.tokenizer, calibration=state.calibration, train_ids=state.train_ids,
                       target=state.profile, work_dir=state.run_dir / "work" / stage_dir.name.rsplit("-", 1)[0],
                       seed=cfg.seed, baseline_model=baseline_model, log=say, device=device, dtype=dtype,
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
        score_row_tasks(state, row, model)
    except Exception as exc:  # a broken stage stops the run; earlier work is kept
        row.resources = meter.stop()
        hub.end(label, message=f"error: {type(exc).__name__}")
        record_error(report, row, exc, t0, say)
        return None
    row.resources = meter.stop()
    hub.end(label)
    if not record_gated(report, row, seq.gates.merged_with(stage_cfg.gates), state.baseline_metrics, t0, say):
        return None
    row.artifact = str(stage_dir)
    ckpt.save_stage(stage_dir, model, row.model_dump(mode="json"), stage_cfg.model_dump(mode="json"))
    if cache is not None:
        cache.store(i, stage_dir, row.wall_s)
    report.last_good_artifact = str(stage_dir)
    return model


def _timed_eager(state: RunState) -> bool:
    """Whether an eager row's latency is measured (eager torchao kernels are slow on a CPU: a
    quantized model headed for an export is timed in its runtime unless the config asks)."""
    return not state.quantized or state.profile is None or state.cfg.checks.latency.eager_quantized


def _stage_cache(state: RunState, config_dump: dict, model: torch.nn.Module, device, dtype):
    """The run's :class:`~optimize.stage_cache.StageCache` (``stage_cache: true``), keyed by the model as loaded."""
    cache = StageCache.for_run(config_dump, len(state.cfg.stages), model, calibration=state.calibration,
                               train_ids=state.train_ids, profile=state.profile, device=device, dtype=dtype,
                               checks_key=checks_key(state.cfg))
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
        score_row_tasks(state, row, model)
        row.details["stage_cache"] += ", measured again"
        atomic_write_json(stage_dir / CHECKS_FILE, {"checks_key": checks_key})
    if renamed or remeasured:
        # this run's row for its own resume; replaced, never written through the link, so the cache keeps its own
        atomic_write_json(stage_dir / "row.json", row.model_dump(mode="json"))
    row.artifact = str(stage_dir)
    ok = record_gated(report, row, cfg.gates.merged_with(cfg.stages[i].gates), state.baseline_metrics,
                       time.perf_counter(), state.say)
    row.wall_s = wall
    if ok:
        row.status = "resumed" if row.status == "pass" else row.status
        report.last_good_artifact = str(stage_dir)
    return ok
