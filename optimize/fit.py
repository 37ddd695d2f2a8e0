"""``optimize fit``: price quantization recipes against a device from bytes alone, before exporting.

For a pipeline YAML's model (its config is read, no weights: a meta-device model gives the shapes)
every candidate recipe of the ExecuTorch exporter's own quantization (``export.executorch``:
``quantize`` 8da8w / 8da4w, ``group_size`` 32/64/128, ``lm_head`` same / 8da8w / fp32,
``embedding_quantize`` int8 / int4 / none) is priced:

- ``artifact_bytes``: a single ``.pte``: every Linear at its precision, the embedding table at its own
  (a tied table is stored twice: the lookup and lm_head), the rest fp32;
- ``memory_bytes``: the artifact + XNNPACK's packed copy of the weights a token reads + the KV cache
  at ``max_seq_len`` + one call's logits: the memory model that :mod:`optimize.memory` checks against
  a measured peak (about 2% off for a ``.pte``), without an interpreter (an app embeds the C++ runtime);
- ``decode_ceiling_tok_s``: PREDICTED upper bound, the device's practical bandwidth over the bytes a
  token reads with the cache full (no host measurement: the pipeline's device rows refine it with the
  fraction of the ceiling the artifact reaches on the host);
- ``quality_penalty``: a heuristic ORDER of expected accuracy loss, not a measurement: int8 < int4 g32 <
  g64 < g128 per weight byte, lm_head at int4 counted three times (it costs most of 8da4w's loss,
  docs/executorch.md), the embedding's precision at a quarter. It only picks which recipes to measure.

Then the finalists (``finalists`` of the recipes whose bytes fit, best-looking first) get a measured
perplexity on a short eval (:mod:`optimize.fit_quality`: the exporter's own quantization of the
weights, eager PyTorch). The winner is the lowest measured perplexity within the budgets (memory,
storage, the predicted decode floor, ``max_ppl_pct``), then the smallest. ``fit.md`` holds the table,
``fit.json`` the same as data, ``fit.png`` the plot, ``fit.yaml`` the pipeline YAML with the winner's
``export.executorch`` block (stages that quantize are dropped: the exporter's quantization is what was
priced); run it to measure the winner in the runtime. Nothing fits: :class:`FitRefused` names the
closest recipe and what it misses.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MIB = 2**20

SCHEMES = ("8da8w", "8da4w")
GROUPS = (32, 64, 128)
LM_HEADS = ("same", "8da8w", "fp32")
EMBEDDINGS = ("int8", "int4", None)
#: expected loss per weight byte's worth, by precision: an ordering, not a measurement
_PENALTY = {"fp32": 0.0, "int8": 1.0, "int4g32": 3.0, "int4g64": 4.0, "int4g128": 5.0}


@dataclass
class Priced:
    scheme: str
    group_size: int | None
    lm_head: str
    embedding: str | None
    artifact_bytes: int
    weight_bytes_per_token: int
    kv_cache_bytes: int
    memory_bytes: int
    decode_ceiling_tok_s: float
    quality_penalty: float
    fits: bool = False
    #: largest ratio of what the recipe needs to a budget (<= 1 when it fits); ranks refusals
    miss: float = 0.0
    pareto: bool = False
    why_not: str = ""
    #: measured on a short eval (optimize.fit_quality) for the finalists; None where not measured
    perplexity: float | None = None
    perplexity_delta_pct: float | None = None

    @property
    def measured(self) -> bool:
        return self.perplexity is not None

    def label(self) -> str:
        if self.scheme == "none":
            return "fp32 (no quantization)"
        g = f" g{self.group_size}" if self.group_size else ""
        emb = self.embedding or "fp32"
        return f"{self.scheme}{g}, lm_head {self.lm_head}, embedding {emb}"

    def export_block(self) -> dict:
        block: dict[str, Any] = {"quantize": self.scheme, "lm_head": self.lm_head, "embedding_quantize": self.embedding}
        if self.scheme == "8da4w":
            block["group_size"] = self.group_size
        return block


def _shapes(config: Any):
    """(linear (out, in) by name, lm_head name or None, embedding (vocab, hidden), tied) from a
    meta-device model: no weights are allocated."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    head = next((n for n in linears if n == "lm_head" or n.endswith(".lm_head")), None)
    emb = model.get_input_embeddings().weight.shape
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return linears, head, (int(emb[0]), int(emb[1])), bool(getattr(text, "tie_word_embeddings", False))


def _bytes(out: int, inp: int, precision: str) -> float:
    n = out * inp
    if precision == "fp32":
        return 4.0 * n
    if precision == "int8":
        return n * (1.0 + 5.0 / inp)  # optimize.quant.mixed.quantized_bytes
    g = int(precision.removeprefix("int4g"))
    return n * (0.5 + 5.0 / g)


def price(config: Any, max_seq_len: int, device: Any, *, scheme: str, group_size: int | None, lm_head: str,
          embedding: str | None, shapes=None) -> Priced:
    from optimize.memory import kv_cache_bytes

    linears, head, (vocab, hidden), tied = shapes or _shapes(config)
    body = {"none": "fp32", "8da8w": "int8"}.get(scheme, f"int4g{group_size}")
    head_p = {"same": body, "8da8w": "int8", "fp32": "fp32"}[lm_head]
    emb_p = {"int8": "int8", "int4": "int4g32", None: "fp32"}[embedding]
    per_token = penalty = 0.0
    for name, (o, i) in linears.items():
        p = head_p if name == head else body
        b = _bytes(o, i, p)
        per_token += b
        penalty += (3.0 if name == head and p.startswith("int4") else 1.0) * _PENALTY[p] * o * i
    table = _bytes(vocab, hidden, emb_p)
    penalty += 0.25 * _PENALTY[emb_p] * vocab * hidden
    if head is None and tied:  # no lm_head Linear: the table itself is the head
        per_token += table
    artifact = per_token + table  # a single .pte keeps the lookup table apart from lm_head (tied: twice)
    kv = kv_cache_bytes(config, max_seq_len)
    memory = artifact + per_token + kv + 4 * vocab
    params = sum(o * i for o, i in linears.values()) + vocab * hidden
    ceiling = device.bandwidth.practical_gb_s * 1e9 / (per_token + kv)
    return Priced(scheme=scheme, group_size=group_size if scheme == "8da4w" else None, lm_head=lm_head,
                  embedding=embedding, artifact_bytes=int(artifact), weight_bytes_per_token=int(per_token),
                  kv_cache_bytes=int(kv), memory_bytes=int(memory), decode_ceiling_tok_s=round(ceiling, 2),
                  quality_penalty=round(penalty / params, 4))


def candidates(hidden_widths: list[int]) -> list[dict]:
    """Every recipe whose group size divides the Linear input widths."""
    # the unquantized model, so the table says what it would need
    out = [{"scheme": "none", "group_size": None, "lm_head": "same", "embedding": None}]
    for scheme, lm_head, emb in itertools.product(SCHEMES, LM_HEADS, EMBEDDINGS):
        for g in (GROUPS if scheme == "8da4w" else (None,)):
            if g is not None and any(w % g for w in hidden_widths):
                continue
            if scheme == "8da8w" and lm_head == "8da8w":
                continue  # the same recipe as lm_head: same
            out.append({"scheme": scheme, "group_size": g, "lm_head": lm_head, "embedding": emb})
    return out


def _rank(r: Priced) -> tuple:
    """Best first: measured perplexity where there is one, then the heuristic, then memory."""
    return (0, r.perplexity, r.memory_bytes) if r.measured else (1, r.quality_penalty, r.memory_bytes)


@dataclass
class FitResult:
    device: str
    max_seq_len: int
    rows: list[Priced]
    winner: Priced | None
    paths: dict[str, str]
    quality: dict | None = None
    budgets: dict | None = None

    def table(self) -> str:
        q = self.quality or {}
        measured = (f"perplexity: MEASURED for the finalists on {q['windows']} eval windows ({q['tokens']} tokens; "
                    f"fp32 {q['baseline_perplexity']:.3f}), the exporter's own quantization in eager PyTorch"
                    if q else "perplexity: not measured (--windows 0)")
        lines = [f"Recipes for `{self.device}` at max_seq_len {self.max_seq_len}. Memory: artifact + packed weights "
                 "+ KV + logits, no interpreter (priced from bytes); decode: PREDICTED bandwidth ceiling; "
                 f"quality penalty: heuristic order of the loss, lower is better; {measured}.", "",
                 "| recipe | artifact MiB | memory MiB | decode ceiling tok/s (predicted) | quality penalty "
                 "| perplexity (Δ) | fits | Pareto |",
                 "|---|---:|---:|---:|---:|---:|---|---|"]
        for r in sorted(self.rows, key=_rank):
            mark = " **winner**" if r is self.winner else ""
            ppl = f"{r.perplexity:.3f} ({r.perplexity_delta_pct:+.2f}%)" if r.measured else "–"
            lines.append(f"| {r.label()}{mark} | {r.artifact_bytes / MIB:.1f} | {r.memory_bytes / MIB:.1f} | "
                         f"{r.decode_ceiling_tok_s:.1f} | {r.quality_penalty:.3f} | {ppl} | "
                         f"{'yes' if r.fits else 'no: ' + r.why_not} | {'yes' if r.pareto else ''} |")
        return "\n".join(lines)

    def closest(self) -> Priced | None:
        """The candidate that misses the budgets by the least (the smallest worst ratio of need to limit),
        among those judged: the measured ones, and those the bytes already ruled out."""
        judged = [r for r in self.rows if r.measured or not r.fits or not self.quality]
        return min(judged, key=lambda r: r.miss, default=None)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {"device": self.device, "max_seq_len": self.max_seq_len, "quality": self.quality,
                "budgets": self.budgets, "paths": self.paths,
                "winner": self.winner.label() if self.winner else None,
                "rows": [{**asdict(r), "label": r.label()} for r in self.rows]}


class FitRefused(ValueError):
    """No recipe meets the budgets; the message names the closest candidate and what it misses."""

    def __init__(self, message: str, result: "FitResult"):
        super().__init__(message)
        self.result = result


def fit(config_path: str | Path, device_profile: str, *, target: str = "executorch", out_dir: str | Path | None = None,
        overrides: tuple[str, ...] = (), decode_tok_s: float | None = None, max_memory_gib: float | None = None,
        max_ppl_pct: float | None = None, windows: int = 8, finalists: int = 6,
        log=lambda m: None, progress: bool = False) -> FitResult:
    """Price every candidate recipe for the YAML's model on ``device_profile``, measure the
    perplexity of up to ``finalists`` of those that fit (``windows`` eval windows each; 0: bytes
    only), and write into ``out_dir`` (default ``<run dir>/fit``) ``fit.md`` (the table),
    ``fit.json``, ``fit.png`` (Pareto plot) and ``fit.yaml`` (the YAML with the winner's
    ``export.executorch`` block, its ``target`` and ``device_profile`` set).

    Budgets: the device's usable memory and storage, its ``budgets.decode_tok_s`` (or
    ``decode_tok_s``), ``max_memory_gib`` and ``max_ppl_pct`` (default: the YAML's
    ``gates.perplexity.max_pct_degradation``). Raises :class:`FitRefused` when nothing meets them.

    Quiet unless ``progress``: the measurement's bars and library output go to ``fit.log`` in
    ``out_dir``; ``log`` gets one line per finalist either way."""
    from optimize.config import export_options, load_config, read_yaml
    from targets import load_target
    from targets.atomic import atomic_write_text
    from targets.devices import load_device
    from train.sources import peek_config

    if target != "executorch":
        raise ValueError(f"optimize fit prices the ExecuTorch exporter's recipes; target {target!r} is not priced yet")
    if windows < 0 or finalists < 1:
        raise ValueError(f"windows must be >= 0 and finalists >= 1 (got {windows}, {finalists})")
    cfg = load_config(config_path, overrides, target=target, device_profile=device_profile, check_model=False)
    device = load_device(device_profile)
    profile = load_target(target)
    n = export_options(cfg, profile.exporter, profile).max_seq_len or profile.max_seq_len
    config = peek_config(cfg.model)
    shapes = _shapes(config)
    widths = sorted({i for o, i in shapes[0].values()})
    rows = [price(config, n, device, shapes=shapes, **c) for c in candidates(widths)]
    gate = cfg.gates.perplexity.max_pct_degradation if cfg.gates.perplexity is not None else None
    budgets = {"memory_bytes": min(device.usable_bytes, int(max_memory_gib * 2**30)) if max_memory_gib
               else device.usable_bytes, "storage_bytes": device.storage_bytes,
               "decode_tok_s": decode_tok_s if decode_tok_s is not None else device.budgets.decode_tok_s,
               "max_ppl_pct": max_ppl_pct if max_ppl_pct is not None else gate}
    for r in rows:
        _check_bytes(r, budgets)
    for r in rows:
        r.pareto = not any(o is not r and o.memory_bytes <= r.memory_bytes and o.quality_penalty <= r.quality_penalty
                           and (o.memory_bytes, o.quality_penalty) != (r.memory_bytes, r.quality_penalty) for o in rows)
    out = Path(out_dir) if out_dir else cfg.run_dir() / "fit"
    out.mkdir(parents=True, exist_ok=True)
    quality = None
    if windows:
        chosen = sorted((r for r in rows if r.fits), key=_rank)[:finalists]
        if chosen:
            from optimize import fit_quality
            from optimize.quiet import LogOutput

            with contextlib.nullcontext() if progress else LogOutput(out / "fit.log"):
                quality = fit_quality.measure_finalists(cfg, chosen, max_seq_len=n, windows=windows, log=log)
            limit = budgets["max_ppl_pct"]
            for r in chosen:
                if limit is not None and r.perplexity_delta_pct > limit:
                    r.fits = False
                    r.miss = max(r.miss, r.perplexity_delta_pct / limit if limit else math.inf)
                    r.why_not = f"perplexity {r.perplexity_delta_pct:+.2f}% > {limit:g}%"
    fitting = [r for r in rows if r.fits and (r.measured or not quality)]
    winner = min(fitting, key=_rank) if fitting else None
    result = FitResult(device=device.name, max_seq_len=n, rows=rows, winner=winner, paths={}, quality=quality,
                       budgets=budgets)
    result.paths["md"] = str(atomic_write_text(out / "fit.md", result.table() + "\n"))
    plot = render_fit_plot(result, out / "fit.png")
    if plot is not None:
        result.paths["png"] = str(plot)
    if winner is not None:
        data = read_yaml(config_path)
        # the recipe is the exporter's quantization: stages that quantize would decide it instead
        dropped = [s.label(i) for i, s in enumerate(cfg.stages) if s.quant_scheme() is not None]
        data["stages"] = [d for d, s in zip(data.get("stages") or [], cfg.stages) if s.quant_scheme() is None]
        data.update(target=target, device_profile=device_profile)
        # its own run directory: run as is, it must not resume or overwrite the original YAML's run
        suffix = f"-fit-{device.name}"
        data["name"] = f"{cfg.name}{suffix}"
        if data.get("output_dir"):
            data["output_dir"] = str(data["output_dir"]).rstrip("/") + suffix
        data.setdefault("export", {})
        data["export"]["executorch"] = {**(data["export"].get("executorch") or {}), **winner.export_block()}
        measured = (f", measured perplexity {winner.perplexity:.3f} ({winner.perplexity_delta_pct:+.2f}%) on "
                    f"{quality['windows']} windows" if winner.measured else "")
        header = (f"# optimize fit: {winner.label()} for {device.name} (memory {winner.memory_bytes / MIB:.1f} MiB "
                  f"priced from bytes, predicted decode ceiling {winner.decode_ceiling_tok_s:.1f} tok/s{measured}); "
                  "run it to measure in the runtime\n"
                  + (f"# quantizing stages dropped (the exporter quantizes instead): {', '.join(dropped)}\n"
                     if dropped else ""))
        result.paths["yaml"] = str(atomic_write_text(out / "fit.yaml", header + yaml.safe_dump(data, sort_keys=False)))
    result.paths["json"] = str(out / "fit.json")
    atomic_write_text(out / "fit.json", json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    if winner is None:
        near = result.closest()
        raise FitRefused(f"no recipe fits {device.name}: the closest, {near.label()}, misses by {near.why_not} "
                         f"(table in {result.paths['md']})", result)
    return result


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


def render_fit_plot(result: FitResult, path: Path) -> Path | None:
    """Perplexity change (measured; the heuristic penalty where nothing was measured) against the
    predicted decode ceiling, marker area by memory; the winner starred. None without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - a pinned dependency
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from targets.atomic import atomic_write_bytes

    measured = [r for r in result.rows if r.measured]
    pts = measured or result.rows
    fig, ax = plt.subplots(figsize=(7, 4.5))
    peak = max(r.memory_bytes for r in pts)
    for fits, colour, name in ((True, "tab:green", "fits"), (False, "tab:red", "misses a budget")):
        sel = [r for r in pts if r.fits == fits]
        if sel:
            ax.scatter([r.decode_ceiling_tok_s for r in sel],
                       [r.perplexity_delta_pct if measured else r.quality_penalty for r in sel],
                       s=[30 + 300 * r.memory_bytes / peak for r in sel], c=colour, alpha=0.6, label=name)
    w = result.winner
    if w is not None:
        ax.scatter([w.decode_ceiling_tok_s], [w.perplexity_delta_pct if measured else w.quality_penalty],
                   marker="*", s=300, c="black", label=f"winner: {w.label()}")
    floor = (result.budgets or {}).get("decode_tok_s")
    if floor:
        ax.axvline(floor, ls="--", c="grey", lw=1)
    ax.set_xlabel("decode tok/s, PREDICTED (bandwidth ceiling)")
    ax.set_ylabel("perplexity change %, measured (short eval)" if measured else "quality penalty (heuristic)")
    ax.set_title(f"optimize fit: {result.device} (marker area: memory)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
