"""Depth pruning with healing as a dimension of ``optimize fit`` (``--depths``).

Dropping whole decoder blocks is the one compression that cuts every byte a token reads at once:
weights, KV cache and compute alike (docs/benchmarks.md, ``bench/compress.py``: 30 -> 24 blocks on
SmolLM2-135M decodes 1.26x faster). It also costs far more accuracy than 8-bit weights, and only a
healing fine-tune makes it usable. So a depth is priced from bytes like any recipe (a meta model of
the pruned config), and measured only where one of its recipes fits: the prune and heal stages are
run as the pipeline runs them, and the exporter's quantizations are measured on the healed model.

The stages a depth adds come first in ``fit.yaml``, before the YAML's own stages that do not
quantize (calibration rewrites such as ``awq`` or ``rotate`` must see the pruned model):

- ``prune`` (``method: depth``, ShortGPT block influence on the calibration text; its own gate set
  to warn, since pruning alone loses a lot and the heal is what is judged);
- ``distill`` for ``heal_steps`` steps from the unpruned model (the pipeline's teacher default), left
  out with ``heal_steps: 0``.

Each depth runs once per fit in ``<out>/depth/<n>/`` through :func:`optimize.pipeline.run_pipeline`
(no export), with every gate set to warn so that a heal that misses the YAML's gate still yields a
model to measure (the gates are judged where they belong: fit's ``max_ppl_pct`` on the quantized
result, and ``fit.yaml``'s own run). A re-run of fit resumes those runs; the winner's checkpoints
are hard-linked into ``fit.yaml``'s run directory (:func:`optimize.fit.stages.link_into`, the
checkpoint names hash the same stages), so ``optimize pipeline fit.yaml`` starts at the export.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimize import checkpoints as ckpt
from optimize.config import dump_config, load_config
from optimize.fit import stages as fit_stages
from optimize.pipeline import run_pipeline
from optimize.prune.arch import shape
from optimize.stages.prune import PruneConfig

#: the heal, as examples/prune_distill.yaml writes it; ``steps`` comes from ``heal_steps``
HEAL = {"kind": "distill", "seq_len": 256, "batch": {"micro_batch_size": 4}, "optimizer": {"lr": 1.0e-4},
        "schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1}, "temperature": 1.0,
        "alpha": 0.0, "checkpoint_every_n_steps": 50}


def depth_stages(depth: int, heal_steps: int) -> list[dict]:
    """The stages a recipe at ``depth`` blocks puts before the YAML's own."""
    prune = {"kind": "prune", "method": "depth", "num_hidden_layers": depth, "gates": {"on_fail": "warn"}}
    if not heal_steps:
        return [prune]
    return [prune, {**copy.deepcopy(HEAL), "steps": heal_steps,
                    "schedule": {**HEAL["schedule"], "warmup_steps": min(HEAL["schedule"]["warmup_steps"],
                                                                         heal_steps - 1)}}]


def blocks(config: Any) -> int:
    return int(shape(config)["layers"])


def check_depths(cfg: Any, config: Any, depths: list[int], heal_steps: int) -> None:
    """Refuse, before anything is priced, a depth the prune stage would refuse, and a YAML that
    already prunes depth (two depth searches would compound)."""
    if heal_steps < 0:
        raise ValueError(f"heal_steps must be >= 0, got {heal_steps}")
    if not depths:
        return
    already = [s.label(i) for i, s in enumerate(cfg.stages) if s.kind == "prune" and getattr(s, "method", None) == "depth"]
    if already:
        raise ValueError(f"--depths searches depth pruning, but the YAML already prunes depth ({', '.join(already)}); "
                         "remove that stage or leave --depths out")
    for d in depths:
        if d < 1:
            raise ValueError(f"--depths {d}: the decoder blocks kept must be >= 1")
        problems = PruneConfig(kind="prune", method="depth", num_hidden_layers=d).check_model(config, None)
        if problems:
            raise ValueError(f"--depths {d}: " + "; ".join(problems))


def pruned_config(config: Any, depth: int | None) -> Any:
    """The model config after keeping ``depth`` blocks (None: the config itself), for pricing."""
    if depth is None:
        return config
    return PruneConfig(kind="prune", method="depth", num_hidden_layers=depth).planned_config(config)


def kept_stage_dicts(cfg: Any) -> list[dict]:
    """The YAML's stages that do not quantize, as validated dicts (what fit.yaml keeps)."""
    dumped = dump_config(cfg)["stages"]
    return [d for d, s in zip(dumped, cfg.stages) if s.quant_scheme() is None]


@dataclass
class Healed:
    """A depth's pruned and healed model, as a pipeline run left it."""

    depth: int
    cfg: Any
    dirs: list[Path]
    run_dir: Path
    #: the run's rows: name -> perplexity (eager, the pipeline's full eval)
    perplexity: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def describe(self) -> dict:
        return {"depth": self.depth, "run": str(self.run_dir), "stages": [p.name for p in self.dirs],
                "perplexity": self.perplexity, "wall_s": round(self.wall_s, 1)}


def heal(cfg: Any, depth: int, heal_steps: int, out_dir: Path, *, progress: bool = False) -> Healed:
    """Run the prune and heal stages, then the YAML's kept stages, on ``cfg``'s model (no export,
    every gate warning) in ``out_dir``; resumes what an earlier fit finished there."""
    data = dump_config(cfg)
    stages = depth_stages(depth, heal_steps) + kept_stage_dicts(cfg)
    for s in stages:  # judged on the quantized result by fit, and by fit.yaml's own run
        s["gates"] = {**(s.get("gates") or {}), "on_fail": "warn"}
    data.update(stages=stages, target=None, device_profile=None,
                gates={**(data.get("gates") or {}), "on_fail": "warn"}, name=f"{cfg.name}-depth-{depth}",
                output_dir=str(out_dir))
    heal_cfg = load_config(data, check_model=False)
    report = run_pipeline(heal_cfg, progress=progress)
    if not report.ok:
        raise RuntimeError(f"depth {depth}: the prune/heal run stopped at {report.stopped_at} "
                           f"(report in {out_dir}/report.md)")
    dirs = fit_stages.stage_dirs(heal_cfg, len(heal_cfg.stages))
    missing = [p.name for p in dirs if not ckpt.is_complete(p)]
    if missing:
        raise RuntimeError(f"depth {depth}: the prune/heal run finished without checkpoints {missing}")
    ppl = {r.name: round(r.metrics.perplexity, 4) for r in report.rows
           if r.metrics is not None and r.metrics.perplexity is not None}
    return Healed(depth=depth, cfg=heal_cfg, dirs=dirs, run_dir=out_dir, perplexity=ppl, wall_s=report.wall_s)


__all__ = ["HEAL", "Healed", "blocks", "check_depths", "depth_stages", "heal", "kept_stage_dicts", "pruned_config"]
