"""Unstructured and 2:4 semi-structured weight sparsity (zeros in place; shapes unchanged).

The score of weight ``W_ij`` is ``|W_ij|`` (magnitude) or ``|W_ij| * ||X_j||_2`` (Wanda: the
weight times the norm of the activation it multiplies, measured on calibration text). As in
Wanda, weights compete within each output row, so every output neuron keeps the same share
of its inputs; 2:4 keeps the 2 highest-scoring weights of every 4 consecutive inputs of a row,
the pattern NVIDIA's sparse tensor cores run.

What it buys depends on the runtime: the model stays dense in every file format here, and
neither ExecuTorch's XNNPACK delegate (its sparse kernels cover NCHW convolutions, not the
fully-connected layers of a transformer) nor ONNX Runtime's CPU provider (dense initializers,
dense MatMul) skips zeros. The size on disk and the decode speed are those of the dense model.
"""

from __future__ import annotations

import torch


def row_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask zeroing the ``sparsity`` fraction of lowest scores in every row."""
    rows, cols = score.shape
    k = int(round(cols * sparsity))
    mask = torch.ones_like(score, dtype=torch.bool)
    if k == 0:
        return mask
    drop = torch.topk(score, k, dim=1, largest=False).indices
    mask.scatter_(1, drop, False)
    return mask


def n_of_m_mask(score: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Keep-mask keeping the ``n`` highest scores in every group of ``m`` consecutive inputs."""
    rows, cols = score.shape
    if cols % m:
        raise ValueError(f"{n}:{m} sparsity needs in_features divisible by {m}, got {cols}")
    groups = score.reshape(rows, cols // m, m)
    keep = torch.topk(groups, n, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(-1, keep, True)
    return mask.reshape(rows, cols)


def score(weight: torch.Tensor, norms: torch.Tensor | None) -> torch.Tensor:
    s = weight.detach().abs().float()
    return s * norms.to(s.device)[None, :] if norms is not None else s


@torch.no_grad()
def apply_mask(weight: torch.Tensor, mask: torch.Tensor) -> int:
    """Zero ``weight`` where ``mask`` is False; returns how many weights are zero afterwards."""
    weight.mul_(mask.to(weight.device, weight.dtype))
    return int((weight == 0).sum())


def is_n_of_m(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True if every group of ``m`` consecutive inputs of every row has at most ``n`` non-zeros."""
    rows, cols = weight.shape
    if cols % m:
        return False
    return bool(((weight.reshape(rows, cols // m, m) != 0).sum(-1) <= n).all())
