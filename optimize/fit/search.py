"""``optimize fit``: search the recipes a device can hold, measure the finalists, write the winner.

For a pipeline YAML's model every candidate recipe (:mod:`optimize.footprint.price`: the ExecuTorch
exporter's quantization, ``weights: external`` for a tied table stored once, and each ``max_seq_len``
asked for) is priced from bytes in milliseconds: artifact, memory, the PREDICTED decode ceiling and a
heuristic quality order. The device's budgets rule recipes out; then the finalists (``finalists``
distinct quantizations among the recipes that fit, best-looking first) get a measured perplexity on a
short eval (:mod:`optimize.fit.quality`: the exporter's own quantization of the weights, eager
PyTorch), shared by the recipes that differ only in storage or cache length. They are measured on the
model after the YAML's leading stages that do not quantize, where a run of the YAML already finished
them (:mod:`optimize.fit.stages`, which also links those checkpoints for ``fit.yaml``'s run).
With ``depths``, each decoder-block count is one more dimension: priced from its pruned config, and
measured on the model pruned and healed as the pipeline would (:mod:`optimize.fit.depth`).

The winner: the longest ``max_seq_len`` at which a recipe fits (context is what the app was built
for; a shorter cache is a way to fit, not a preference), then the lowest measured perplexity within
the budgets (memory, storage, the predicted decode floor, ``max_ppl_pct``), then the least memory,
then the smallest artifact.
``fit.md`` holds the table, ``fit.json`` the same as data, ``fit.png`` the plot, ``fit.yaml`` the
pipeline YAML with the winner's ``export.executorch`` block (stages that quantize are dropped: the
exporter's quantization is what was priced); run it to measure the winner in the runtime. Nothing
fits: :class:`FitRefused` names the closest recipe and what it misses.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from optimize.config import load_config, read_yaml
from optimize.config_checks import export_options
from optimize.fit import depth as fit_depth, export as fit_export, plot as fit_plot, quality as fit_quality, stages as fit_stages
from optimize.footprint.price import Priced, candidates, model_shapes, price
from optimize.quiet import LogOutput
from targets import load_target
from targets.atomic import atomic_write_text
from targets.devices import load_device
from targets.sources import peek_config

MIB = 2**20


def _rank(r: Priced) -> tuple:
    """Best first: exported and measured in the runtime, then measured in eager, then priced only;
    within each, the longest cache, then the perplexity (else the heuristic), then memory, then storage."""
    if r.runtime is not None:
        return 0, -r.max_seq_len, r.runtime["perplexity"], r.memory_bytes, r.artifact_bytes
    return ((1, -r.max_seq_len, r.perplexity, r.memory_bytes, r.artifact_bytes) if r.measured
            else (2, -r.max_seq_len, r.quality_penalty, r.memory_bytes, r.artifact_bytes))


def _finalists(rows: list[Priced], n: int) -> list[Priced]:
    """Up to ``n`` recipes that fit at each depth, one per distinct quantization, best-looking first
    (a depth's heal is its cost; measuring its quantizations after it is cheap)."""
    chosen: dict[tuple, Priced] = {}
    per_depth: dict[int | None, int] = {}
    for r in sorted((r for r in rows if r.fits), key=_rank):
        if r.quant_key() not in chosen and per_depth.get(r.depth, 0) < n:
            chosen[r.quant_key()] = r
            per_depth[r.depth] = per_depth.get(r.depth, 0) + 1
    return list(chosen.values())


@dataclass
class FitResult:
    device: str
    max_seq_len: int
    rows: list[Priced]
    winner: Priced | None
    paths: dict[str, str]
    quality: dict | None = None
    budgets: dict | None = None
    #: every cache length priced (max_seq_len: the YAML's)
    max_seq_lens: list[int] = field(default_factory=list)
    #: stage checkpoints of the YAML's run linked into fit.yaml's run directory (optimize.fit.stages)
    reused_stages: list[str] = field(default_factory=list)
    #: decoder-block counts searched beside the full depth (optimize.fit.depth), and their heal's steps
    depths: list[int] = field(default_factory=list)
    heal_steps: int | None = None

    def table(self) -> str:
        q = self.quality or {}
        measured = (f"perplexity: MEASURED for the finalists on {q['windows']} eval windows ({q['tokens']} tokens; "
                    f"fp32 {q['baseline_perplexity']:.3f}), the exporter's own quantization in eager PyTorch, of "
                    f"{q.get('model', 'the model as loaded')}" if q else "perplexity: not measured (--windows 0)")
        lens = self.max_seq_lens or [self.max_seq_len]
        if self.depths:
            healed = ", ".join(f"{d} blocks: fp32 {v['fp32_perplexity']:.3f} after a {self.heal_steps}-step heal"
                               if self.heal_steps else f"{d} blocks: fp32 {v['fp32_perplexity']:.3f}, not healed"
                               for d, v in (q.get("depths") or {}).items())
            measured += (f"; depth-pruned recipes measured on the healed model against the unpruned fp32"
                         + (f" ({healed})" if healed else " (no depth was a finalist: none healed)"))
        lines = [f"Recipes for `{self.device}` at max_seq_len {', '.join(map(str, lens))}. Memory: artifact + packed weights "
                 "+ KV + logits, no interpreter (priced from bytes); decode: PREDICTED bandwidth ceiling; "
                 f"quality penalty: heuristic order of the loss, lower is better; {measured}.", "",
                 "| recipe | artifact MiB | memory MiB | decode ceiling tok/s (predicted) | quality penalty "
                 "| perplexity (Δ) | exported: MiB · ExecuTorch perplexity (Δ) · host tok/s · device tok/s PREDICTED "
                 "| fits | Pareto |",
                 "|---|---:|---:|---:|---:|---:|---|---|---|"]
        for r in sorted(self.rows, key=_rank):
            mark = " **winner**" if r is self.winner else ""
            ppl = f"{r.perplexity:.3f} ({r.perplexity_delta_pct:+.2f}%)" if r.measured else "–"
            rt = r.runtime
            ran = (f"{rt['artifact_bytes'] / MIB:.1f} · {rt['perplexity']:.3f} ({rt['perplexity_delta_pct']:+.2f}%) · "
                   f"{rt['host_decode_tok_s']:.1f} · {rt['predicted_decode_tok_s']}" if rt else "–")
            if rt is None and r.predicted_decode:
                pd = r.predicted_decode
                ran = (f"not exported: host {pd['host_decode_tok_s']} · device {pd['predicted_decode_tok_s']} tok/s "
                       f"PREDICTED from {pd['source']}'s measured efficiency")
            lines.append(f"| {r.label(self.several_lengths)}{mark} | {r.artifact_bytes / MIB:.1f} | {r.memory_bytes / MIB:.1f} | "
                         f"{r.decode_ceiling_tok_s:.1f} | {r.quality_penalty:.3f} | {ppl} | {ran} | "
                         f"{'yes' if r.fits else 'no: ' + r.why_not} | {'yes' if r.pareto else ''} |")
        return "\n".join(lines)

    @property
    def several_lengths(self) -> bool:
        return len(self.max_seq_lens) > 1

    def closest(self) -> Priced | None:
        """The candidate that misses the budgets by the least (the smallest worst ratio of need to limit),
        among those judged: the measured ones, and those the bytes already ruled out."""
        judged = [r for r in self.rows if r.measured or not r.fits or not self.quality]
        return min(judged, key=lambda r: r.miss, default=None)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {"device": self.device, "max_seq_len": self.max_seq_len, "max_seq_lens": self.max_seq_lens,
                "reused_stages": self.reused_stages, "depths": self.depths, "heal_steps": self.heal_steps,
                "quality": self.quality,
                "budgets": self.budgets, "paths": self.paths,
                "winner": self.winner.label(self.several_lengths) if self.winner else None,
                "rows": [{**asdict(r), "label": r.label(self.several_lengths)} for r in self.rows]}


class FitRefused(ValueError):
    """No recipe meets the budgets; the message names the closest candidate and what it misses."""

    def __init__(self, message: str, result: "FitResult"):
        super().__init__(message)
        self.result = result


def fit(config_path: str | Path, device_profile: str, *, target: str = "executorch", out_dir: str | Path | None = None,
        overrides: tuple[str, ...] = (), decode_tok_s: float | None = None, max_memory_gib: float | None = None,
        max_ppl_pct: float | None = None, windows: int = 8, finalists: int = 6,
        max_seq_lens: list[int] | tuple[int, ...] | None = None, export_finalists: int = 0,
        depths: list[int] | tuple[int, ...] | None = None, heal_steps: int = 32, log=lambda m: None,
        progress: bool = False) -> FitResult:
    """Price every candidate recipe for the YAML's model on ``device_profile``, measure the
    perplexity of up to ``finalists`` of those that fit (``windows`` eval windows each; 0: bytes
    only), and write into ``out_dir`` (default ``<run dir>/fit``) ``fit.md`` (the table),
    ``fit.json``, ``fit.png`` (Pareto plot) and ``fit.yaml`` (the YAML with the winner's
    ``export.executorch`` block, its ``target`` and ``device_profile`` set).

    Budgets: the device's usable memory and storage, its ``budgets.decode_tok_s`` (or
    ``decode_tok_s``), ``max_memory_gib`` and ``max_ppl_pct`` (default: the YAML's
    ``gates.perplexity.max_pct_degradation``). Raises :class:`FitRefused` when nothing meets them.

    ``max_seq_lens``: the KV-cache lengths to price (default: the YAML's, or its target profile's);
    the winner is at the longest one where a recipe fits, so listing shorter ones lets the search
    trade context for memory when nothing fits at full length. Each is checked as the exporter would
    (the model's position limit, its sliding windows) before anything is priced.

    ``export_finalists``: the best that many measured recipes that fit (distinct quantizations) are
    also exported and measured in ExecuTorch (:mod:`optimize.fit.export`); the winner is then the
    exported recipe with the lowest runtime perplexity within the budgets.

    ``depths``: decoder-block counts to search beside the full depth (:mod:`optimize.fit.depth`):
    each is priced from its pruned config; where one of its recipes is a finalist, the model is
    depth-pruned and healed by ``heal_steps`` distillation steps from the unpruned model (a
    pipeline run in ``<out_dir>/depth/<n>``, resumed by a re-run), and its quantizations are
    measured on the healed model against the unpruned baseline. A depth that wins puts its
    ``prune`` and ``distill`` stages first in ``fit.yaml``, whose run resumes from their checkpoints.

    Quiet unless ``progress``: the measurement's bars and library output go to ``fit.log`` in
    ``out_dir``; ``log`` gets one line per finalist either way."""
    if target != "executorch":
        raise ValueError(f"optimize fit prices the ExecuTorch exporter's recipes; target {target!r} is not priced yet")
    if windows < 0 or finalists < 1 or export_finalists < 0:
        raise ValueError(f"windows must be >= 0, finalists >= 1 and export_finalists >= 0 (got {windows}, {finalists}, "
                         f"{export_finalists})")
    if export_finalists and not windows:
        raise ValueError("export_finalists needs windows > 0: the exported recipes are the best measured ones")
    cfg = load_config(config_path, overrides, target=target, device_profile=device_profile, check_model=False)
    device = load_device(device_profile)
    profile = load_target(target)
    opts = export_options(cfg, profile.exporter, profile)
    n = opts.max_seq_len or profile.max_seq_len
    config = peek_config(cfg.model)
    lengths = sorted(set(max_seq_lens or [n]), reverse=True)
    _check_lengths(config, opts, lengths)
    depths = sorted(set(depths or ()), reverse=True)
    fit_depth.check_depths(cfg, config, depths, heal_steps)
    blocks = fit_depth.blocks(config) if depths else None
    rows = []
    for depth in [None, *depths]:  # a meta model of each pruned config gives its shapes
        conf = fit_depth.pruned_config(config, depth)
        shapes = model_shapes(conf)
        widths = sorted({i for o, i in shapes[0].values()})
        rows += [price(conf, length, device, shapes=shapes, depth=depth, blocks=blocks, **c) for length in lengths
                 for c in candidates(widths, tied=shapes[3])]
    gate = cfg.gates.perplexity.max_pct_degradation if cfg.gates.perplexity is not None else None
    budgets = {"memory_bytes": min(device.usable_bytes, int(max_memory_gib * 2**30)) if max_memory_gib
               else device.usable_bytes, "storage_bytes": device.storage_bytes,
               "decode_tok_s": decode_tok_s if decode_tok_s is not None else device.budgets.decode_tok_s,
               "max_ppl_pct": max_ppl_pct if max_ppl_pct is not None else gate}
    for r in rows:
        _check_bytes(r, budgets)
    for r in rows:
        r.pareto = not any(o is not r and o.max_seq_len >= r.max_seq_len and o.memory_bytes <= r.memory_bytes
                           and o.quality_penalty <= r.quality_penalty
                           and (o.memory_bytes, o.quality_penalty, o.max_seq_len)
                           != (r.memory_bytes, r.quality_penalty, r.max_seq_len) for o in rows)
    out = Path(out_dir) if out_dir else cfg.run_dir() / "fit"
    out.mkdir(parents=True, exist_ok=True)
    quality = None
    finished = fit_stages.finished(cfg)  # leading stages a run of the YAML already did: measured after them
    #: depth -> (config, checkpoints) of the model its recipes are measured (and exported) on
    sources: dict[int | None, tuple] = {None: (cfg, finished)}
    if windows:
        chosen = _finalists(rows, finalists)
        if chosen:
            with contextlib.nullcontext() if progress else LogOutput(out / "fit.log"):
                # one eval for every length, so the perplexities compare
                quality = _measure(chosen, sources, out, lengths[-1], windows, heal_steps, progress, log)
            by_key = {r.quant_key(): r for r in chosen}
            limit = budgets["max_ppl_pct"]
            for r in rows:  # the recipes that differ from a finalist only in storage or cache length share it
                m = by_key.get(r.quant_key())
                if m is None or not r.fits:
                    continue
                r.perplexity, r.perplexity_delta_pct = m.perplexity, m.perplexity_delta_pct
                if limit is not None and r.perplexity_delta_pct > limit:
                    r.fits = False
                    r.miss = max(r.miss, r.perplexity_delta_pct / limit if limit else math.inf)
                    r.why_not = f"perplexity {r.perplexity_delta_pct:+.2f}% > {limit:g}%"
    fitting = [r for r in rows if r.fits and (r.measured or not quality)]
    if export_finalists and quality and fitting:
        with contextlib.nullcontext() if progress else LogOutput(out / "fit.log"):
            quality["runtime"] = _export_best(sources, fitting, export_finalists, device, out, quality, lengths[-1],
                                              budgets, log, config)
        fitting = [r for r in fitting if r.fits]
    winner = min(fitting, key=_rank) if fitting else None
    result = FitResult(device=device.name, max_seq_len=n, rows=rows, winner=winner, paths={}, quality=quality,
                       budgets=budgets, max_seq_lens=lengths, depths=depths, heal_steps=heal_steps if depths else None)
    result.paths["md"] = str(atomic_write_text(out / "fit.md", result.table() + "\n"))
    plot = fit_plot.render(result, out / "fit.png")
    if plot is not None:
        result.paths["png"] = str(plot)
    if winner is not None:
        data = read_yaml(config_path)
        # the recipe is the exporter's quantization: stages that quantize would decide it instead
        dropped = [s.label(i) for i, s in enumerate(cfg.stages) if s.quant_scheme() is not None]
        data["stages"] = [d for d, s in zip(data.get("stages") or [], cfg.stages) if s.quant_scheme() is None]
        if winner.depth is not None:  # pruned and healed first: the kept stages calibrate on the pruned model
            data["stages"] = fit_depth.depth_stages(winner.depth, heal_steps) + data["stages"]
        data.update(target=target, device_profile=device_profile)
        # its own run directory: run as is, it must not resume or overwrite the original YAML's run
        suffix = f"-fit-{device.name}"
        data["name"] = f"{cfg.name}{suffix}"
        if data.get("output_dir"):
            data["output_dir"] = str(data["output_dir"]).rstrip("/") + suffix
        data.setdefault("export", {})
        block = winner.export_block() | ({"max_seq_len": winner.max_seq_len} if winner.max_seq_len != n else {})
        data["export"]["executorch"] = {**(data["export"].get("executorch") or {}), **block}
        measured = (f", measured perplexity {winner.perplexity:.3f} ({winner.perplexity_delta_pct:+.2f}%) on "
                    f"{quality['windows']} windows" if winner.measured else "")
        if winner.runtime:
            rt = winner.runtime
            measured += (f"; exported: {rt['artifact_bytes'] / MIB:.1f} MiB, ExecuTorch perplexity {rt['perplexity']:.3f} "
                         f"({rt['perplexity_delta_pct']:+.2f}%), {rt['predicted_decode_tok_s']} tok/s PREDICTED from "
                         f"the host's measured {rt['host_decode_tok_s']:.1f}")
        header = (f"# optimize fit: {winner.label(result.several_lengths)} for {device.name} (memory {winner.memory_bytes / MIB:.1f} MiB "
                  f"priced from bytes, predicted decode ceiling {winner.decode_ceiling_tok_s:.1f} tok/s{measured}); "
                  "run it to measure in the runtime\n"
                  + (f"# quantizing stages dropped (the exporter quantizes instead): {', '.join(dropped)}\n"
                     if dropped else "")
                  + (f"# depth {winner.depth} of {blocks} blocks: prune (ShortGPT block influence) and "
                     + (f"a {heal_steps}-step distillation heal" if heal_steps else "no heal (--heal-steps 0)")
                     + " added first\n" if winner.depth is not None else ""))
        result.paths["yaml"] = str(atomic_write_text(out / "fit.yaml", header + yaml.safe_dump(data, sort_keys=False)))
        # fit.yaml's run resumes after the stages the YAML's run finished instead of redoing them
        linked = fit_stages.link_into(load_config(out / "fit.yaml", check_model=False), sources.get(winner.depth, (None, []))[1])
        result.reused_stages = [str(p) for p in linked]
        if linked:
            log(f"fit: {len(linked)} finished stage checkpoint(s) linked into fit.yaml's run directory")
    result.paths["json"] = str(out / "fit.json")
    atomic_write_text(out / "fit.json", json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    if winner is None:
        near = result.closest()
        raise FitRefused(f"no recipe fits {device.name}: the closest, {near.label(result.several_lengths)}, misses by {near.why_not} "
                         f"(table in {result.paths['md']})", result)
    return result


def _measure(chosen: list[Priced], sources: dict, out: Path, seq_len: int, windows: int, heal_steps: int,
             progress: bool, log) -> dict:
    """Measure the finalists (optimize.fit.quality): the full-depth ones on the model after the
    finished leading stages, each depth's after its prune and heal (optimize.fit.depth), which adds
    that depth's source to ``sources``. Every perplexity change is against the unpruned model's."""
    base_cfg, finished = sources[None]
    quality = fit_quality.measure_finalists(base_cfg, [r for r in chosen if r.depth is None], max_seq_len=seq_len,
                                            windows=windows, log=log, after=finished)
    for depth in sorted({r.depth for r in chosen if r.depth is not None}, reverse=True):
        log(f"fit: depth {depth}: pruning and healing ({heal_steps} steps) in {out / 'depth' / str(depth)}")
        healed = fit_depth.heal(base_cfg, depth, heal_steps, out / "depth" / str(depth), progress=progress)
        sources[depth] = (healed.cfg, healed.dirs)
        q = fit_quality.measure_finalists(healed.cfg, [r for r in chosen if r.depth == depth], max_seq_len=seq_len,
                                          windows=windows, log=log, after=healed.dirs,
                                          baseline=quality["baseline_perplexity"])
        quality.setdefault("depths", {})[depth] = {**healed.describe(), "model": q["model"],
                                                   "fp32_perplexity": q["model_perplexity"]}
    return quality


def _export_best(sources: dict, fitting: list[Priced], k: int, device, out: Path, quality: dict, seq_len: int,
                 budgets: dict, log, config) -> dict:
    """Export the best ``k`` distinct quantizations of ``fitting`` (optimize.fit.export), each from
    its depth's model in ``sources``, and hold their runtime figures to the budgets: the runtime
    perplexity, the decode PREDICTED from the measured one. The other measured recipes get a decode
    PREDICTED from the nearest exported one (shown, not gated: no runtime measured them)."""
    best: dict[tuple, Priced] = {}
    for r in sorted(fitting, key=_rank):
        if len(best) < k:
            best.setdefault(r.quant_key(), r)
    info: dict = {}
    for depth, (src_cfg, dirs) in sources.items():
        group = [r for r in best.values() if r.depth == depth]
        if group:
            info = fit_export.export_finalists(src_cfg, group, device, out if depth is None else out / "depth" / str(depth),
                                               windows=quality["windows"], seq_len=seq_len,
                                               baseline=quality["baseline_perplexity"], after=dirs, log=log)
    info["exported"] = len(best)
    for r in fitting:
        if r.runtime is None and r.measured:
            r.predicted_decode = fit_export.predict_from_nearest(r, list(best.values()), device,
                                                                 fit_depth.pruned_config(config, r.depth))
    limit, floor = budgets["max_ppl_pct"], budgets["decode_tok_s"]
    for r in best.values():
        delta, rate = r.runtime["perplexity_delta_pct"], r.runtime["predicted_decode_tok_s"]
        why = ([f"runtime perplexity {delta:+.2f}% > {limit:g}%"] if limit is not None and delta > limit else []) + (
            [f"predicted {rate:.1f} < budget {floor:g} tok/s from the measured decode"]
            if floor is not None and rate is not None and rate < floor else [])
        if why:
            r.fits, r.why_not = False, "; ".join(why)
            r.miss = max(r.miss, delta / limit if limit else 1.0, floor / rate if floor and rate else 1.0)
    return info


def _check_lengths(config, opts, lengths: list[int]) -> None:
    """Refuse a cache length the exporter would refuse, before pricing anything."""
    from export.executorch import ExecuTorchExporter

    for length in lengths:
        if length < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {length}")
        # the length alone (fit sets the rest): the exporter's own validation-time refusals
        problems = ExecuTorchExporter().check_model(config, type(opts)(max_seq_len=length))
        if problems:
            raise ValueError(f"max_seq_len {length}: " + "; ".join(problems))


def _check_bytes(r: Priced, budgets: dict) -> None:
    """``fits``, ``miss`` and ``why_not`` from what bytes tell: memory, storage, the decode ceiling."""
    why, miss = [], 0.0
    if r.memory_bytes > budgets["memory_bytes"]:
        why.append(f"memory {r.memory_bytes / MIB:.0f} > usable {budgets['memory_bytes'] / MIB:.0f} MiB")
    miss = max(miss, r.memory_bytes / budgets["memory_bytes"])
    if r.artifact_bytes > budgets["storage_bytes"]:
        why.append(f"artifact {r.artifact_bytes / MIB:.0f} > storage {budgets['storage_bytes'] / MIB:.0f} MiB")
    miss = max(miss, r.artifact_bytes / budgets["storage_bytes"])
    floor = budgets["decode_tok_s"]
    if floor is not None:
        if r.decode_ceiling_tok_s < floor:
            why.append(f"predicted ceiling {r.decode_ceiling_tok_s:.1f} < budget {floor:g} tok/s")
        miss = max(miss, floor / r.decode_ceiling_tok_s)
    r.fits, r.why_not, r.miss = not why, "; ".join(why), miss
