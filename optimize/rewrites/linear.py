"""Uniform float64 access to linear-like layers (``nn.Linear`` and GPT-2's transposed ``Conv1D``).

The folding algebra is written once for a weight laid out ``[out, in]``; this module hides
that GPT-2 stores ``[in, out]`` and that some layers have no bias yet.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

LinearLike = (nn.Linear, Conv1D)


def is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, LinearLike)


def weight_out_in(mod: nn.Module) -> torch.Tensor:
    """The weight as a float64 ``[out, in]`` copy."""
    w = mod.weight.detach().to(torch.float64)
    return w.t().contiguous() if isinstance(mod, Conv1D) else w.clone()


def bias_or_zeros(mod: nn.Module) -> torch.Tensor:
    out = mod.weight.shape[1] if isinstance(mod, Conv1D) else mod.weight.shape[0]
    if getattr(mod, "bias", None) is None:
        return torch.zeros(out, dtype=torch.float64, device=mod.weight.device)
    return mod.bias.detach().to(torch.float64).clone()


def set_weight_out_in(mod: nn.Module, w: torch.Tensor) -> None:
    w = w.t() if isinstance(mod, Conv1D) else w
    with torch.no_grad():
        mod.weight.copy_(w.to(mod.weight.dtype))


def set_bias(mod: nn.Module, b: torch.Tensor) -> bool:
    """Write the bias, creating the parameter if the layer had none. Returns True if created."""
    created = getattr(mod, "bias", None) is None
    if created:
        mod.bias = nn.Parameter(torch.zeros(b.shape[0], dtype=mod.weight.dtype, device=mod.weight.device))
    with torch.no_grad():
        mod.bias.copy_(b.to(mod.bias.dtype))
    return created
