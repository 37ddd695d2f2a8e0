"""The module a grid-keeping quantization leaves in a model, and that every exporter must trace.

:class:`GroupOffsetLinear` computes ``W x + b`` for a weight on an affine 4-bit grid (GGUF
Q4_1/Q4_K) as XNNPACK's symmetric int4 plus one constant per group of input columns (see
:mod:`optimize.quant.source_grid`, which finds the grids and installs them). It lives here,
below both, because exporters (the projection fusion, the ONNX plan) read its parts.

Why the group sums come out of the int4 Linear itself: XNNPACK runs 4-D pooling channels-last,
and the reshapes around it left the delegate (a 30-layer model went from 93 to 212 delegate
calls a token). Rows of ones over each group, appended to the int4 weight (``q = 1``, scale 1:
exact), make the same GEMM emit the sums; a static slice splits them off for the offset Linear.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupOffsetLinear(nn.Module):
    """``y = z[:out] + offset(z[out:])`` with ``z = linear(x)``: ``linear`` holds the symmetric int4
    rows of the weight followed by one row per group of ``group_size`` input columns that sums
    the group; ``offset`` (groups -> out, with the original bias) holds each group's constant."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, device=None):
        super().__init__()
        self.group_size = group_size
        self.in_features, self.out_features = in_features, out_features
        self.groups = in_features // group_size
        self.linear = nn.Linear(in_features, out_features + self.groups, bias=False, device=device)
        self.offset = nn.Linear(self.groups, out_features, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.linear(x)
        return z[..., : self.out_features] + self.offset(z[..., self.out_features :])


def pool_rows(in_features: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that sum each group: integers (1 on the group's columns) and their scales (1.0)."""
    groups = in_features // group_size
    q = torch.zeros(groups, in_features, dtype=torch.int8)
    for j in range(groups):
        q[j, j * group_size : (j + 1) * group_size] = 1
    return q, torch.ones(groups, groups)
