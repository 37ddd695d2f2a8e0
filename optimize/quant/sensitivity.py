"""Which modules lose the most accuracy when quantized: one group at a time, ranked.

Each group (a decoder block, one projection type across all blocks, the output projection,
the embedding table, or single Linears) is quantized alone with the target's scheme while
everything else stays fp32, and the KL divergence, top-1 agreement and perplexity change
are measured on calibration windows (text held apart from the evaluation span).

Quantization is *simulated* with fake-quant (:mod:`optimize.quant.fakequant`): weights are
quantized-dequantized once and activations per token, which reproduces torchao's
``IntxUnpackedToInt8Tensor`` numerics bit for bit but runs at fp32 speed (eager torchao int8
is ~14x slower on CPU). The ranking feeds mixed precision (:mod:`optimize.quant.mixed`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal, Sequence

import torch
from pydantic import BaseModel, Field
from torch import nn

from export.decoding.runtime import EagerRunner
from optimize.checks.accuracy import BaselineLogits, evaluate
from optimize.module_select import resolve_patterns
from optimize.quant.fakequant import fake_quantized, scheme_for
from targets.atomic import atomic_path, atomic_write_json, atomic_write_text
from targets.group_size import widths_error
from train.model_parts import block_of, decoder_blocks

GroupKind = Literal["blocks", "projections", "lm_head", "embeddings", "modules", "custom"]
DEFAULT_GROUPS: tuple[GroupKind, ...] = ("blocks", "projections", "lm_head", "embeddings")


class SensitivityEntry(BaseModel):
    name: str = Field(description="group label, e.g. 'model.layers.3', '*.down_proj', 'lm_head'")
    kind: GroupKind = Field(description="how the group was formed")
    modules: list[str] = Field(description="module names quantized together")
    params: int = Field(ge=0, description="weights in the group")
    kl: float = Field(description="mean KL(fp32 || quantized) per token, nats")
    perplexity: float = Field(gt=0, description="perplexity on the calibration windows with this group quantized")
    delta_ppl_pct: float = Field(description="perplexity change vs fp32 on the same windows, percent")
    top1_agreement: float = Field(ge=0, le=1, description="argmax agreement with fp32")


class SensitivityReport(BaseModel):
    scheme: str = Field(description="quantization scheme simulated (8da4w, 8da8w, w4, w8, w8a8-tensor)")
    group_size: int | None = Field(None, description="int4 group size, None for per-channel int8")
    algorithm: str = Field("rtn", description="weight scale choice: rtn or hqq")
    method: str = Field(
        "fake-quant (weights quantize-dequantized once, activations per token; same numerics as torchao)",
        description="how quantization was simulated",
    )
    windows: int = Field(ge=1, description="calibration windows scored")
    tokens: int = Field(ge=1, description="targets scored per group")
    baseline_perplexity: float = Field(gt=0, description="fp32 perplexity on the same windows")
    wall_s: float = Field(ge=0, description="seconds the analysis took")
    entries: list[SensitivityEntry] = Field(description="groups, most sensitive (highest KL) first")

    def ranked_modules(self, kinds: Sequence[GroupKind] | None = None) -> list[SensitivityEntry]:
        """Entries of the given kinds, most sensitive first."""
        return [e for e in self.entries if kinds is None or e.kind in kinds]

    def table(self, limit: int | None = None) -> str:
        """A markdown table of the ranking."""
        lines = [
            f"Sensitivity to {self.scheme}" + (f" g{self.group_size}" if self.group_size else "")
            + f" ({self.algorithm}), {self.windows} calibration windows, {self.tokens} tokens; "
            f"fp32 ppl {self.baseline_perplexity:.3f}. Method: {self.method}.",
            "",
            "| rank | group | kind | params | KL | ppl | Δppl % | top-1 |",
            "|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        for i, e in enumerate(self.entries[:limit] if limit else self.entries, 1):
            lines.append(
                f"| {i} | {e.name} | {e.kind} | {e.params:,} | {e.kl:.5f} | {e.perplexity:.3f} | "
                f"{e.delta_ppl_pct:+.2f} | {e.top1_agreement:.3f} |"
            )
        return "\n".join(lines) + "\n"


def _linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def module_groups(model: nn.Module, kinds: Sequence[GroupKind] = DEFAULT_GROUPS) -> list[tuple[str, GroupKind, list[str]]]:
    """``(label, kind, module names)`` for every requested grouping of the model's layers."""
    bad = [k for k in kinds if k not in ("blocks", "projections", "lm_head", "embeddings", "modules")]
    if bad:
        raise ValueError(f"unknown sensitivity group kind(s) {bad}; choose from blocks, projections, lm_head, embeddings, modules")
    head = (resolve_patterns(model, ["lm_head"]) or [None])[0]
    emb = (resolve_patterns(model, ["embeddings"]) or [None])[0]
    body = [n for n in _linears(model) if n != head]
    out: list[tuple[str, GroupKind, list[str]]] = []
    if "blocks" in kinds:
        names = [b for b, _ in decoder_blocks(model)]
        blocks: dict[str, list[str]] = {}
        for n in body:
            b = block_of(n, names)
            if b is not None:
                blocks.setdefault(b, []).append(n)
        out += [(b, "blocks", ns) for b, ns in blocks.items()]
    if "projections" in kinds:
        proj: dict[str, list[str]] = {}
        for n in body:
            proj.setdefault("*." + n.rsplit(".", 1)[-1], []).append(n)
        out += [(p, "projections", ns) for p, ns in proj.items() if len(ns) > 1]
    if "modules" in kinds:
        out += [(n, "modules", [n]) for n in body]
    if "lm_head" in kinds and head and isinstance(model.get_submodule(head), nn.Linear):
        out.append((head, "lm_head", [head]))
    if "embeddings" in kinds and emb and isinstance(model.get_submodule(emb), nn.Embedding):
        out.append((emb, "embeddings", [emb]))
    if not out:
        raise ValueError(f"no module groups of kinds {list(kinds)} in {type(model).__name__}")
    return out


@torch.no_grad()
def analyze_sensitivity(
    model: nn.Module,
    windows: list[torch.Tensor],
    scheme: str = "8da4w",
    groups: Sequence[GroupKind] = DEFAULT_GROUPS,
    *,
    group_size: int = 32,
    algorithm: Literal["rtn", "hqq"] = "rtn",
    custom: list[tuple[str, list[str]]] | None = None,
    log=None,
) -> SensitivityReport:
    """Quantize each module group alone (fake-quant) and rank groups by KL against fp32.

    ``windows`` are 1-D LongTensors of calibration text (not the evaluation span). ``custom``
    replaces ``groups`` with explicit ``(label, module names)`` pairs. The model is restored
    unchanged afterwards.
    """
    if not windows:
        raise ValueError("analyze_sensitivity needs at least one calibration window")
    if any(w.dim() != 1 or w.numel() < 2 for w in windows):
        raise ValueError("calibration windows must be 1-D token tensors of at least 2 tokens")
    sch = scheme_for(scheme, group_size, algorithm)
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    runner = EagerRunner(model)
    base = BaselineLogits()
    ref = evaluate(runner, windows, keep=base, desc="sensitivity fp32")
    entries = []
    plan = [(label, "custom", names) for label, names in custom] if custom else module_groups(model, groups)
    mods = dict(model.named_modules())
    for i, (label, kind, names) in enumerate(plan):
        if sch.group_size:
            why = widths_error(sch.group_size, {n: mods[n].in_features for n in names if isinstance(mods[n], nn.Linear)})
            if why:
                raise ValueError(f"sensitivity group {label}: {why}")
        with fake_quantized(model, names, sch):
            r = evaluate(runner, windows, base, desc=f"sensitivity {label}")
        entries.append(SensitivityEntry(
            name=label, kind=kind, modules=names, params=sum(mods[n].weight.numel() for n in names),
            kl=max(float(r.kl_divergence), 0.0), perplexity=r.perplexity,
            delta_ppl_pct=100.0 * (r.perplexity / ref.perplexity - 1.0), top1_agreement=float(r.top1_agreement),
        ))
        if log:
            log(f"sensitivity {i + 1}/{len(plan)} {label}: KL {entries[-1].kl:.4f}, Δppl {entries[-1].delta_ppl_pct:+.2f}%")
    model.train(was_training)
    entries.sort(key=lambda e: e.kl, reverse=True)
    return SensitivityReport(
        scheme=scheme, group_size=sch.group_size, algorithm=algorithm, windows=len(windows), tokens=ref.tokens,
        baseline_perplexity=ref.perplexity, wall_s=time.perf_counter() - t0, entries=entries,
    )


def _plot(report: SensitivityReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ents = report.entries[:40]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.22 * len(ents) + 1)))
    colors = {"blocks": "tab:blue", "projections": "tab:orange", "lm_head": "tab:red", "embeddings": "tab:green",
              "modules": "tab:gray", "custom": "tab:purple"}
    ax.barh([e.name for e in ents][::-1], [e.kl for e in ents][::-1], color=[colors[e.kind] for e in ents][::-1])
    ax.set_xlabel("KL(fp32 || quantized), nats/token")
    ax.set_title(f"Sensitivity to {report.scheme} (one group quantized at a time)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def write_sensitivity(report: SensitivityReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``sensitivity.json``, ``sensitivity.md`` and ``sensitivity.png`` atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "sensitivity.json", "md": out / "sensitivity.md", "png": out / "sensitivity.png"}
    atomic_write_json(paths["json"], report.model_dump(mode="json"))
    atomic_write_text(paths["md"], report.table())
    _plot(report, paths["png"])
    return paths
