"""Where the equalization folds go in each supported architecture, and what its norms compute.

A fold divides one activation's channels by ``s`` where it is produced and multiplies the
weight columns that read it by ``s``. That is exact only if the producer really is the one
feeding those readers, and if its scale is folded the way the module computes it:

- the norm that feeds the attention projections is ``input_layernorm`` everywhere here; the
  one that feeds the MLP is ``post_attention_layernorm`` in Llama-style blocks but
  ``pre_feedforward_layernorm`` in Gemma2/Gemma3, whose ``post_attention_layernorm``
  normalises the attention *output* (folding into it rescales the residual stream: that
  took a Gemma model's perplexity from 37.6 to 66571);
- Gemma's RMSNorm computes ``x * (1 + w)``; dividing its output by ``s`` means
  ``w' = (1 + w) / s - 1``, not ``w / s`` (:func:`norm_offset` measures the offset);
- Phi-3 fuses ``qkv_proj`` and ``gate_up_proj``: the v rows and the up rows are slices;
- Mixtral's MLP is a mixture of experts: ``post_attention_layernorm`` feeds the router and every
  expert's gate/up projections (one ``gate_up`` group, the router's columns scaled too, so its
  logits and every routing decision stay as they were), and each expert's up rows feed only its
  own down projection (one ``down`` group per expert), on the per-expert Linears of
  :mod:`targets.moe`;
- Qwen3/Gemma3 normalise q and k per head after the projection (``q_norm``/``k_norm``): no
  fold here changes a q or k projection's output (``qkv`` rescales their input columns with
  the inverse folded into the norm before them, ``o`` touches only v), so those norms see
  the same values. A value norm (``v_norm``) would break the ``o`` fold, which is refused.

Architectures not listed are refused with the list of supported ones, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class FoldRefused(ValueError):
    """An equalization fold cannot be applied exactly here; the message says why and what would."""


@dataclass(frozen=True)
class FoldLayout:
    #: norm whose output feeds the attention projections
    attn_norm: str = "input_layernorm"
    #: norm whose output feeds the MLP's gate/up projections
    mlp_norm: str = "post_attention_layernorm"
    #: name of a fused q/k/v projection (rows q | k | v), else separate q_proj/k_proj/v_proj
    fused_qkv: str | None = None
    #: name of a fused gate/up projection (rows gate | up), else separate gate_proj/up_proj
    fused_gate_up: str | None = None
    #: what the norms compute, for messages (the fold measures it: :func:`norm_offset`)
    norm: str = "x * w"
    #: a mixture of experts: the MLP's experts module, split into per-expert Linears
    #: (:func:`targets.moe.unfuse_experts`), and the router beside it that reads the same activation
    experts: str | None = None
    router: str | None = None


_GEMMA2 = FoldLayout(mlp_norm="pre_feedforward_layernorm", norm="x * (1 + w)")

LAYOUTS: dict[str, FoldLayout] = {
    "llama": FoldLayout(),
    "mistral": FoldLayout(),
    "qwen2": FoldLayout(),
    "qwen3": FoldLayout(),
    "phi3": FoldLayout(fused_qkv="qkv_proj", fused_gate_up="gate_up_proj"),
    "gemma": FoldLayout(norm="x * (1 + w)"),
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2,
    "mixtral": FoldLayout(experts="experts", router="gate"),
}


def model_type(config: Any) -> str:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None) or getattr(config, "model_type", "?")


def layout_for(config: Any) -> FoldLayout:
    """The fold layout of a transformers config's architecture, or FoldRefused."""
    mt = model_type(config)
    if mt not in LAYOUTS:
        raise FoldRefused(
            f"architecture {mt!r} has no equalization fold layout (which norm feeds which projections); "
            f"supported: {', '.join(sorted(LAYOUTS))}"
        )
    return LAYOUTS[mt]


@torch.no_grad()
def norm_offset(norm: nn.Module, name: str) -> float:
    """``c`` in ``norm(x) = n(x) * (c + weight) [+ bias]``: 0 for Llama/LayerNorm, 1 for Gemma.

    Measured on the module (two probe forwards with the weight shifted by one, then put back
    bit for bit) rather than assumed from its class, so a norm computing something else is
    refused instead of folded wrongly."""
    if isinstance(norm, nn.LayerNorm):
        if norm.weight is None:
            raise FoldRefused(f"{name}: LayerNorm without elementwise_affine has no weight to fold scales into")
        return 0.0
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise FoldRefused(f"{name} ({type(norm).__name__}) has no per-channel weight to fold scales into")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, w.numel(), generator=gen).to(device=w.device, dtype=w.dtype)
    orig = w.detach().clone()
    try:
        y0 = norm(x).float()
        w.add_(1.0)
        y1 = norm(x).float()
    finally:
        w.copy_(orig)
    n = y1 - y0  # the normalised input, times the unit shift
    bias = getattr(norm, "bias", None)
    y = y0 - (bias.detach().float() if isinstance(bias, torch.Tensor) else 0.0)
    c = (n * y).sum(0) / n.pow(2).sum(0).clamp_min(1e-12) - orig.float()
    mid = float(c.median())
    target = round(mid)
    spread = float((c - target).abs().max())
    if target not in (0, 1) or spread > 0.05:
        raise FoldRefused(
            f"{name} ({type(norm).__name__}) does not compute n(x) * w or n(x) * (1 + w) (measured offset "
            f"{mid:.3g}, spread {spread:.3g}); its scale cannot be folded exactly"
        )
    return float(target)
