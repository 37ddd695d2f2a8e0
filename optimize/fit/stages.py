"""The stages ``optimize fit`` keeps, and the checkpoints of them a run of the YAML already finished.

``fit.yaml`` keeps the YAML's stages that do not quantize (distillation, pruning, rewrites) and drops
those that do: the exporter's quantization is what was priced. A pipeline run of the original YAML
may already have finished the leading ones. Their checkpoints (:mod:`optimize.checkpoints`) are keyed
by a hash of the model, data, seed and every stage up to each, which the leading non-quantizing
stages of ``fit.yaml`` share. So fit:

- measures the finalists on the model after the longest finished leading prefix (not the model as
  loaded, which a distillation or a rewrite has since changed);
- hard-links those checkpoint directories into ``fit.yaml``'s own run directory, so
  ``optimize pipeline fit.yaml`` resumes after them instead of training again (no copy: the files
  are read-only once complete).

Only the leading prefix carries over: a stage after a dropped quantizing stage saw a quantized model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from optimize import checkpoints as ckpt
from optimize.config import dump_config
from optimize.stage_api import restorers
from targets.sources import load_model


def leading_kept(cfg: Any) -> int:
    """How many of the YAML's first stages do not quantize (fit.yaml keeps them, in the same places)."""
    n = 0
    for stage in cfg.stages:
        if stage.quant_scheme() is not None:
            break
        n += 1
    return n


def stage_dirs(cfg: Any, upto: int) -> list[Path]:
    """The checkpoint directories of ``cfg``'s first ``upto`` stages in its run directory."""
    dump = dump_config(cfg)
    return [ckpt.stage_dir(cfg.run_dir(), i, s.kind, ckpt.prefix_hash(dump, i))
            for i, s in enumerate(cfg.stages[:upto])]


def finished(cfg: Any) -> list[Path]:
    """The finished checkpoints of the leading kept stages, in order (empty: none, or resume: false)."""
    if not cfg.resume:
        return []
    out = []
    for path in stage_dirs(cfg, leading_kept(cfg)):
        if not ckpt.is_complete(path):
            break
        out.append(path)
    return out


def load_after(cfg: Any, dirs: list[Path]):
    """The model after the last of ``dirs`` (float32, eval), rebuilt as the pipeline resumes it."""
    model, _ = ckpt.load_stage(dirs[-1], restorers(cfg.stages[:len(dirs)]))
    return model.float().eval()


def load_measured(cfg: Any, dirs: list[Path]):
    """(model, tokenizer) the recipes are measured on: the model after the last of ``dirs`` (the
    finished leading stages), else as loaded; float32, eval; one model in memory at a time."""
    loaded = load_model(cfg.model)
    if not dirs:
        return loaded.model.float().eval(), loaded.tokenizer
    loaded.model = None
    return load_after(cfg, dirs), loaded.tokenizer


def describe(cfg: Any, dirs: list[Path]) -> str:
    kept = leading_kept(cfg)
    if not dirs:
        return ("the model as loaded" + (f" (the YAML's first {kept} stage(s) do not quantize and have no finished "
                                         "checkpoint: run the YAML first to measure after them)" if kept else ""))
    names = ", ".join(s.label(i) for i, s in enumerate(cfg.stages[:len(dirs)]))
    rest = f"; stage(s) {len(dirs)}..{kept - 1} not finished, not run" if len(dirs) < kept else ""
    return f"the model after {names} (checkpoint {dirs[-1]}{rest})"


def link_into(fit_cfg: Any, dirs: list[Path]) -> list[Path]:
    """Hard-link each of ``dirs`` into ``fit_cfg``'s run directory under the name its own hash gives
    (they match for the leading kept stages); stops at the first that does not match or exists."""
    targets = stage_dirs(fit_cfg, len(dirs))
    linked = []
    for src, dst in zip(dirs, targets):
        if src.name != dst.name or dst.exists():
            break
        tmp = dst.with_name(dst.name + ".linking")
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted fit left
        for f in sorted(src.rglob("*")):
            out = tmp / f.relative_to(src)
            if f.is_dir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, out)
            except OSError:  # another file system: a copy
                shutil.copy2(f, out)
        os.replace(tmp, dst)  # whole or absent: a reader never sees half a checkpoint
        linked.append(dst)
    return linked


__all__ = ["describe", "finished", "leading_kept", "link_into", "load_after", "load_measured", "stage_dirs"]
