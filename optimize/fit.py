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
  docs/executorch.md), the embedding's precision at a quarter.

The Pareto front is over (memory, quality penalty); the winner is the lowest penalty that fits the
device's usable memory and storage (and its decode budget, against the ceiling), then the smallest.
``fit.md`` holds the table, ``fit.yaml`` the pipeline YAML with the winner's ``export.executorch``
block (stages that quantize are dropped: the exporter's quantization is what was priced); run it to
measure what was priced.
"""

from __future__ import annotations

import copy
import itertools
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
    pareto: bool = False
    why_not: str = ""

    def label(self) -> str:
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
    body = "int8" if scheme == "8da8w" else f"int4g{group_size}"
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
    out = []
    for scheme, lm_head, emb in itertools.product(SCHEMES, LM_HEADS, EMBEDDINGS):
        for g in (GROUPS if scheme == "8da4w" else (None,)):
            if g is not None and any(w % g for w in hidden_widths):
                continue
            if scheme == "8da8w" and lm_head == "8da8w":
                continue  # the same recipe as lm_head: same
            out.append({"scheme": scheme, "group_size": g, "lm_head": lm_head, "embedding": emb})
    return out


@dataclass
class FitResult:
    device: str
    max_seq_len: int
    rows: list[Priced]
    winner: Priced | None
    paths: dict[str, str]

    def table(self) -> str:
        lines = [f"Recipes priced from bytes for `{self.device}` at max_seq_len {self.max_seq_len} "
                 "(memory: artifact + packed weights + KV + logits, no interpreter; decode: PREDICTED bandwidth "
                 "ceiling; quality: heuristic order, lower is better)", "",
                 "| recipe | artifact MiB | memory MiB | decode ceiling tok/s (predicted) | quality penalty | fits | Pareto |",
                 "|---|---:|---:|---:|---:|---|---|"]
        for r in sorted(self.rows, key=lambda r: (r.quality_penalty, r.memory_bytes)):
            mark = " **winner**" if r is self.winner else ""
            lines.append(f"| {r.label()}{mark} | {r.artifact_bytes / MIB:.1f} | {r.memory_bytes / MIB:.1f} | "
                         f"{r.decode_ceiling_tok_s:.1f} | {r.quality_penalty:.3f} | "
                         f"{'yes' if r.fits else 'no: ' + r.why_not} | {'yes' if r.pareto else ''} |")
        return "\n".join(lines)


def fit(config_path: str | Path, device_profile: str, *, target: str = "executorch", out_dir: str | Path | None = None,
        overrides: tuple[str, ...] = ()) -> FitResult:
    """Price every candidate recipe for the YAML's model on ``device_profile``; write ``fit.md``
    (the table) and ``fit.yaml`` (the YAML with the winner's ``export.executorch`` block, its
    ``target`` and ``device_profile`` set) into ``out_dir`` (default ``<run dir>/fit``)."""
    from optimize.config import export_options, load_config, read_yaml
    from targets import load_target
    from targets.atomic import atomic_write_text
    from targets.devices import load_device
    from train.sources import peek_config

    if target != "executorch":
        raise ValueError(f"optimize fit prices the ExecuTorch exporter's recipes; target {target!r} is not priced yet")
    cfg = load_config(config_path, overrides, target=target, device_profile=device_profile, check_model=False)
    device = load_device(device_profile)
    profile = load_target(target)
    n = export_options(cfg, profile.exporter, profile).max_seq_len or profile.max_seq_len
    config = peek_config(cfg.model)
    shapes = _shapes(config)
    widths = sorted({i for o, i in shapes[0].values()})
    rows = [price(config, n, device, shapes=shapes, **c) for c in candidates(widths)]
    budget = device.budgets.decode_tok_s
    for r in rows:
        why = []
        if r.memory_bytes > device.usable_bytes:
            why.append(f"memory {r.memory_bytes / MIB:.0f} > usable {device.usable_bytes / MIB:.0f} MiB")
        if r.artifact_bytes > device.storage_bytes:
            why.append(f"artifact {r.artifact_bytes / MIB:.0f} > storage {device.storage_bytes / MIB:.0f} MiB")
        if budget is not None and r.decode_ceiling_tok_s < budget:
            why.append(f"predicted ceiling {r.decode_ceiling_tok_s:.1f} < budget {budget:g} tok/s")
        r.fits, r.why_not = not why, "; ".join(why)
    for r in rows:
        r.pareto = not any(o is not r and o.memory_bytes <= r.memory_bytes and o.quality_penalty <= r.quality_penalty
                           and (o.memory_bytes, o.quality_penalty) != (r.memory_bytes, r.quality_penalty) for o in rows)
    fitting = [r for r in rows if r.fits]
    winner = min(fitting, key=lambda r: (r.quality_penalty, r.memory_bytes)) if fitting else None
    out = Path(out_dir) if out_dir else cfg.run_dir() / "fit"
    out.mkdir(parents=True, exist_ok=True)
    result = FitResult(device=device.name, max_seq_len=n, rows=rows, winner=winner, paths={})
    result.paths["md"] = str(atomic_write_text(out / "fit.md", result.table() + "\n"))
    if winner is not None:
        data = read_yaml(config_path)
        # the recipe is the exporter's quantization: stages that quantize would decide it instead
        dropped = [s.label(i) for i, s in enumerate(cfg.stages) if s.quant_scheme() is not None]
        data["stages"] = [d for d, s in zip(data.get("stages") or [], cfg.stages) if s.quant_scheme() is None]
        data.update(target=target, device_profile=device_profile)
        data.setdefault("export", {})
        data["export"]["executorch"] = {**(data["export"].get("executorch") or {}), **winner.export_block()}
        header = (f"# optimize fit: {winner.label()} for {device.name} (priced from bytes: memory "
                  f"{winner.memory_bytes / MIB:.1f} MiB, predicted decode ceiling {winner.decode_ceiling_tok_s:.1f} "
                  "tok/s); run it to measure\n"
                  + (f"# quantizing stages dropped (the exporter quantizes instead): {', '.join(dropped)}\n"
                     if dropped else ""))
        result.paths["yaml"] = str(atomic_write_text(out / "fit.yaml", header + yaml.safe_dump(data, sort_keys=False)))
    return result
