"""Fake quantization: the numerics of the shipped int8/int4 schemes at fp32 speed.

torchao's eager ``IntxUnpackedToInt8Tensor`` linear quantizes and de-quantizes the weight on
every call (and the activation per token), which is ~14x slower than fp32 on this CPU. The
weight part does not change between calls, so here it is quantized-dequantized once; the
per-token activation quantize-dequantize is a few vectorised ops. The arithmetic follows
torchao 0.18 (symmetric weights with ``scale = amax / ((qmax - qmin) / 2)``, asymmetric int8
activations per token), so sensitivity and search results carry over to the exported model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
import torch.nn.functional as F
from torch import nn

Algorithm = Literal["rtn", "hqq"]
_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class WeightScheme:
    """How one Linear's weight (and input) is quantized."""

    bits: int
    group_size: int | None  # None = one scale per output channel
    act_int8: bool  # dynamic per-token int8 activations (the "8da" part)
    algorithm: Algorithm = "rtn"
    #: act_int8 only: one scale for the whole activation tensor (ORT's DynamicQuantizeLinear)
    #: instead of one per token
    act_per_tensor: bool = False

    @property
    def qrange(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1


#: scheme name -> (weight bits, int8 activations, per-tensor activations)
SCHEMES = {"8da4w": (4, True, False), "8da8w": (8, True, False), "w4": (4, False, False), "w8": (8, False, False),
           "w8a8-tensor": (8, True, True)}


def scheme_for(name: str, group_size: int | None = 32, algorithm: Algorithm = "rtn") -> WeightScheme:
    """The fake-quant twin of a target scheme name: ``8da4w``/``8da8w`` (XNNPACK, and ORT's
    ``dynamic_per_token``), ``w4``/``w8`` (weights only), ``w8a8-tensor`` (ORT's dynamic quantizer:
    one activation scale per tensor)."""
    if name not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {name!r}; expected one of {sorted(SCHEMES)}")
    bits, act, per_tensor = SCHEMES[name]
    return WeightScheme(bits=bits, group_size=group_size if bits == 4 else None, act_int8=act, algorithm=algorithm,
                        act_per_tensor=per_tensor)


def _grouped(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    out_f, in_f = w.shape
    gs = in_f if group_size is None else group_size
    if in_f % gs:
        raise ValueError(f"group_size={gs} does not divide in_features={in_f}")
    return w.reshape(out_f, in_f // gs, gs)


def weight_scales(w: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """Per-group scales ``[out, n_groups]``: torchao's affine choice or HQQ's scale search."""
    qmin, qmax = scheme.qrange
    wg = _grouped(w.float(), scheme.group_size)
    if scheme.algorithm == "hqq":
        from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_scale_only_hqq

        gs = scheme.group_size or w.shape[1]
        _, scale = _choose_qparams_and_quantize_scale_only_hqq(w.float(), [1, gs], qmin, qmax)
        return scale.reshape(wg.shape[0], wg.shape[1]).float()
    amax = wg.abs().amax(dim=2)
    return (amax / ((qmax - qmin) / 2)).clamp_min(_EPS)


def qdq_weight(w: torch.Tensor, scheme: WeightScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize a 2-D weight with symmetric group-wise (or per-channel) scales."""
    qmin, qmax = scheme.qrange
    s = weight_scales(w, scheme) if scale is None else scale
    wg = _grouped(w.float(), scheme.group_size)
    q = torch.clamp(torch.round(wg * (1.0 / s.unsqueeze(-1))), qmin, qmax)  # torchao multiplies by 1/scale
    return (q * s.unsqueeze(-1)).reshape(w.shape).to(w.dtype)


def qdq_act_per_token(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric int8 per token (last dim), as torchao's dynamic activation quantization.

    fp32 arithmetic, as the kernels run it; a float64 input (a host-independent calibration,
    :mod:`optimize.quant.host_independent`) stays float64, so the CPU path's last bits in it do not
    reach the rounding through a cast to fp32."""
    xf = x if x.dtype == torch.float64 else x.float()
    mn = xf.amin(dim=-1, keepdim=True).clamp(max=0)
    mx = xf.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = ((mx - mn) / 255.0).clamp_min(_EPS)
    zp = torch.clamp(-128 - torch.round(mn / scale), -128, 127)
    q = torch.clamp(torch.round(xf * (1.0 / scale)) + zp, -128, 127)
    return ((q - zp) * scale).to(x.dtype)


def qdq_act_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric uint8 with one scale for the whole tensor, as ORT's ``DynamicQuantizeLinear``."""
    xf = x.float()
    mn, mx = xf.min().clamp(max=0), xf.max().clamp(min=0)
    scale = ((mx - mn) / 255.0).clamp_min(_EPS)
    zp = torch.clamp(torch.round(-mn / scale), 0, 255)
    q = torch.clamp(torch.round(xf / scale) + zp, 0, 255)
    return ((q - zp) * scale).to(x.dtype)


def qdq_act(x: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """The scheme's activation quantize-dequantize (identity for weight-only schemes)."""
    if not scheme.act_int8:
        return x
    return qdq_act_per_tensor(x) if scheme.act_per_tensor else qdq_act_per_token(x)


class FakeQuantLinear(nn.Module):
    """A Linear whose weight is pre-quantized-dequantized and whose input is fake-quantized."""

    def __init__(self, linear: nn.Linear, scheme: WeightScheme):
        super().__init__()
        self.scheme = scheme
        self.register_buffer("weight", qdq_weight(linear.weight.detach(), scheme), persistent=False)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(qdq_act(x, self.scheme), self.weight, self.bias)


def qdq_embedding(emb: nn.Embedding, bits: int = 8, group_size: int | None = None) -> nn.Embedding:
    """A copy of ``emb`` with weight-only quantized-dequantized rows (int8 per row, int4 groups)."""
    scheme = WeightScheme(bits=bits, group_size=group_size, act_int8=False)
    out = nn.Embedding(emb.num_embeddings, emb.embedding_dim, padding_idx=emb.padding_idx)
    out.weight = nn.Parameter(qdq_weight(emb.weight.detach(), scheme), requires_grad=False)
    return out


@contextlib.contextmanager
def fake_quantized(
    model: nn.Module, names: list[str], scheme: WeightScheme
) -> Iterator[nn.Module]:
    """Temporarily swap the named Linear (and Embedding) modules for fake-quantized copies.

    Modules are swapped, never mutated, so a tied lm_head keeps its fp32 weight when only
    the embedding is fake-quantized (and vice versa). Embeddings are weight-only with the
    scheme's bits (int4 in groups of the scheme's group size, int8 per row), as ptq_int8's
    ``quantize_embedding`` stores them. The originals are restored on exit.
    """
    originals = {n: model.get_submodule(n) for n in names}
    try:
        for n, mod in originals.items():
            if isinstance(mod, nn.Linear):
                model.set_submodule(n, FakeQuantLinear(mod, scheme), strict=True)
            elif isinstance(mod, nn.Embedding):
                model.set_submodule(n, qdq_embedding(mod, bits=scheme.bits, group_size=scheme.group_size), strict=True)
            else:
                raise TypeError(f"{n} is a {type(mod).__name__}; only nn.Linear and nn.Embedding fake-quantize")
        yield model
    finally:
        for n, mod in originals.items():
            model.set_submodule(n, mod, strict=True)
