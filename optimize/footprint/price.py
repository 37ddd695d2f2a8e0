"""What one ``optimize fit`` recipe costs on a device, from bytes alone: no weights, no export.

A recipe is the ExecuTorch exporter's own quantization (``export.executorch``: ``quantize`` 8da8w /
8da4w, ``group_size`` 32/64/128, ``attention`` same / 8da8w under 8da4w (per layer type: int8 attention
beside an int4 MLP), ``lm_head`` same / 8da8w / fp32, ``embedding_quantize`` int8 / int4 / none), where the weights live (``weights``: one ``.pte``, or ``external`` for a tied model whose table
and lm_head then hold identical bytes, which ``model.ptd`` stores once) and the KV cache's length
(``max_seq_len``), and with ``optimize fit --depths`` how many decoder blocks are kept (``depth``:
pruned and healed, :mod:`optimize.fit.depth`; its meta model is the pruned config's). A meta-device
model gives the shapes; each recipe is priced as:

- ``artifact_bytes``: every Linear at its precision, the embedding table at its own (a tied table is
  stored twice in a single ``.pte``: the lookup and lm_head; once in ``model.ptd`` when both are fp32,
  or the table int8 and lm_head 8da8w: ``export.executorch.exporter.SHARED_PAIRS``), the rest fp32;
- ``memory_bytes``: the artifact + XNNPACK's packed copy of the weights a token reads + the KV cache at
  ``max_seq_len`` + one call's logits: the memory model :mod:`optimize.footprint.memory` checks against a measured
  peak (about 2% off for a tiny ``.pte``, 7-12% over for SmolLM2's shape), without an interpreter (an
  app embeds the C++ runtime). The artifact counted is the single ``.pte``'s even under ``weights:
  external``: the table stored once measured the same peak as stored twice (docs/devices.md);
- ``decode_ceiling_tok_s``: PREDICTED upper bound, the device's practical bandwidth over the bytes a
  token reads with the cache full;
- ``quality_penalty``: a heuristic ORDER of expected accuracy loss, not a measurement: int8 < int4 g32 <
  g64 < g128 per weight byte, lm_head at int4 counted three times (it costs most of 8da4w's loss,
  docs/executorch.md), the embedding's precision at a quarter, and each dropped block's share of the
  depth at ``DEPTH_PENALTY`` (a healed 30 -> 24 on SmolLM2-135M lost about 45% perplexity,
  docs/benchmarks.md). It only orders recipes that were not measured.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

from optimize.footprint.memory import kv_cache_bytes

SCHEMES = ("8da8w", "8da4w")
GROUPS = (32, 64, 128)
LM_HEADS = ("same", "8da8w", "fp32")
EMBEDDINGS = ("int8", "int4", None)
#: expected loss per weight byte's worth, by precision: an ordering, not a measurement
_PENALTY = {"fp32": 0.0, "int8": 1.0, "int4g32": 3.0, "int4g64": 4.0, "int4g128": 5.0}
#: (table, lm_head) precisions a tied pair shares in model.ptd (export.executorch.exporter.SHARED_PAIRS)
_SHARED = (("fp32", "fp32"), ("int8", "int8"))
#: the quality penalty of dropping every block (scaled by the share dropped): an ordering only
DEPTH_PENALTY = 50.0


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
    max_seq_len: int = 0
    weights: str = "embedded"
    attention: str = "same"
    #: decoder blocks kept by depth pruning and healing (optimize.fit.depth); None: every block
    depth: int | None = None
    fits: bool = False
    #: largest ratio of what the recipe needs to a budget (<= 1 when it fits); ranks refusals
    miss: float = 0.0
    pareto: bool = False
    why_not: str = ""
    #: measured on a short eval (optimize.fit.quality) for the finalists; None where not measured
    perplexity: float | None = None
    perplexity_delta_pct: float | None = None
    #: exported and measured in ExecuTorch (optimize.fit.export, --export-finalists); None where not
    runtime: dict | None = None
    #: the Linear bytes a token reads by the scheme that computes them (fp32 / 8da8w / 8da4w), as an
    #: export row records them: what optimize.footprint.predict.nearest_source compares
    weight_bytes_by_scheme: dict[str, int] | None = None
    #: measured but not exported: decode PREDICTED from the nearest exported recipe's measured
    #: efficiency (optimize.fit.export.predict_from_nearest); None where not
    predicted_decode: dict | None = None

    @property
    def measured(self) -> bool:
        return self.perplexity is not None

    def quant_key(self) -> tuple:
        """What decides the weights' values (so the perplexity): recipes that differ only in where the
        weights are stored or in the cache's length share one measurement."""
        return self.scheme, self.group_size, self.lm_head, self.embedding, self.attention, self.depth

    def label(self, with_len: bool = False) -> str:
        text = "fp32 (no quantization)"
        if self.scheme != "none":
            g = f" g{self.group_size}" if self.group_size else ""
            att = f", attention {self.attention}" if self.attention != "same" else ""
            text = f"{self.scheme}{g}{att}, lm_head {self.lm_head}, embedding {self.embedding or 'fp32'}"
        if self.depth is not None:
            text = f"{self.depth} blocks (depth-pruned), " + text
        if self.weights == "external":
            text += ", weights external (tied table once)"
        return text + (f", max_seq_len {self.max_seq_len}" if with_len else "")

    def export_block(self) -> dict:
        block: dict[str, Any] = {"quantize": self.scheme, "lm_head": self.lm_head, "embedding_quantize": self.embedding}
        if self.scheme == "8da4w":
            block["group_size"] = self.group_size
        if self.weights == "external":
            block["weights"] = "external"
        if self.attention != "same":
            block["attention"] = self.attention
        return block


def model_shapes(config: Any):
    """(linear (out, in) by name, lm_head name or None, embedding (vocab, hidden), tied) from a
    meta-device model: no weights are allocated."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    out = model.get_output_embeddings()
    head = next((n for n, m in model.named_modules() if out is not None and m is out and n in linears),
                next((n for n in linears if n == "lm_head" or n.endswith(".lm_head")), None))  # GPT-NeoX: embed_out
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


def _precisions(scheme: str, group_size: int | None, lm_head: str, embedding: str | None) -> tuple[str, str, str]:
    """(body, lm_head, table) precisions of a recipe."""
    body = {"none": "fp32", "8da8w": "int8"}.get(scheme, f"int4g{group_size}")
    head = {"same": body, "8da8w": "int8", "fp32": "fp32"}[lm_head]
    return body, head, {"int8": "int8", "int4": "int4g32", None: "fp32"}[embedding]


def shares_table(scheme: str, group_size: int | None, lm_head: str, embedding: str | None, **_) -> bool:
    """Whether a tied model's table and lm_head hold identical bytes under this recipe (so
    ``weights: external`` stores them once)."""
    _, head, table = _precisions(scheme, group_size, lm_head, embedding)
    return (table, head) in _SHARED


def price(config: Any, max_seq_len: int, device: Any, *, scheme: str, group_size: int | None, lm_head: str,
          embedding: str | None, weights: str = "embedded", attention: str = "same", shapes=None,
          depth: int | None = None, blocks: int | None = None) -> Priced:
    """``config`` is the model's (pruned to ``depth`` blocks where given, of ``blocks`` originally)."""
    from export.executorch import is_attention
    linears, head, (vocab, hidden), tied = shapes or model_shapes(config)
    body, head_p, emb_p = _precisions(scheme, group_size, lm_head, embedding)
    att_p = {"same": body, "8da8w": "int8", "fp32": "fp32"}[attention]
    per_token = penalty = 0.0
    by_scheme: dict[str, float] = {}
    for name, (o, i) in linears.items():
        p = head_p if name == head else att_p if is_attention(name) else body
        per_token += _bytes(o, i, p)
        key = {"fp32": "fp32", "int8": "8da8w"}.get(p, "8da4w")
        by_scheme[key] = by_scheme.get(key, 0.0) + _bytes(o, i, p)
        penalty += (3.0 if name == head and p.startswith("int4") else 1.0) * _PENALTY[p] * o * i
    table = _bytes(vocab, hidden, emb_p)
    penalty += 0.25 * _PENALTY[emb_p] * vocab * hidden
    dropped = (blocks - depth) / blocks if depth is not None and blocks else 0.0
    if head is None and tied:  # no lm_head Linear: the table itself is the head
        per_token += table
    once = weights == "external" and tied and head is not None and (emb_p, head_p) in _SHARED
    artifact = per_token + (0 if once else table)  # a single .pte keeps the lookup table apart from lm_head
    kv = kv_cache_bytes(config, max_seq_len)
    # storing the table once saves storage, not memory: the peak measured the same either way
    # (SmolLM2's shape, 4 blocks: 109.7 MB int8, 406 MB fp32; docs/devices.md)
    memory = (per_token + table) + per_token + kv + 4 * vocab  # the single .pte's artifact, whatever is written
    params = sum(o * i for o, i in linears.values()) + vocab * hidden
    ceiling = device.bandwidth.practical_gb_s * 1e9 / (per_token + kv)
    return Priced(scheme=scheme, group_size=group_size if scheme == "8da4w" else None, lm_head=lm_head,
                  embedding=embedding, artifact_bytes=int(artifact), weight_bytes_per_token=int(per_token),
                  kv_cache_bytes=int(kv), memory_bytes=int(memory), decode_ceiling_tok_s=round(ceiling, 2),
                  quality_penalty=round(penalty / params + DEPTH_PENALTY * dropped, 4), max_seq_len=max_seq_len,
                  weights=weights, attention=attention, depth=depth,
                  weight_bytes_by_scheme={k: int(v) for k, v in by_scheme.items()})


def candidates(hidden_widths: list[int], tied: bool = False) -> list[dict]:
    """Every recipe whose group size divides the Linear input widths; for a tied model, each recipe
    whose table and lm_head share their bytes once more with ``weights: external``."""
    # the unquantized model, so the table says what it would need
    out = [{"scheme": "none", "group_size": None, "lm_head": "same", "embedding": None}]
    for scheme, lm_head, emb in itertools.product(SCHEMES, LM_HEADS, EMBEDDINGS):
        for g in (GROUPS if scheme == "8da4w" else (None,)):
            if g is not None and any(w % g for w in hidden_widths):
                continue
            if scheme == "8da8w" and lm_head == "8da8w":
                continue  # the same recipe as lm_head: same
            out.append({"scheme": scheme, "group_size": g, "lm_head": lm_head, "embedding": emb})
            if scheme == "8da4w":  # per layer type: int8 attention beside an int4 MLP
                out.append({"scheme": scheme, "group_size": g, "lm_head": lm_head, "embedding": emb,
                            "attention": "8da8w"})
    if tied:
        out += [{**c, "weights": "external"} for c in out if shares_table(**c)]
    return out


__all__ = ["Priced", "candidates", "model_shapes", "price", "shares_table"]
