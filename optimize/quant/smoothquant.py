"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights before W8A8.

Per input channel j of each group, ``s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)``; the
activation is divided by ``s`` and the weights multiplied, folded exactly into the
preceding norm or linear (see :mod:`optimize.quant.equalize`), so the fp32 model computes
the same logits and the runtime pays nothing. Static per-tensor activation quantization
(ORT QDQ) gains the most; per-token dynamic (XNNPACK 8da8w) gains less but never pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from optimize.quant.equalize import FoldGroup, FoldKind, apply_fold, collect_stats, fold_groups, reduce

_FLOOR = 1e-5


@dataclass
class SmoothResult:
    groups: int
    alpha: float
    #: mean over groups of max|X| / median max|X| per channel, before and after (outlier ratio)
    outlier_ratio_before: float
    outlier_ratio_after: float
    scale_range: tuple[float, float]


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant's per-channel scale for one group of readers (weights ``[out, in]``)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must lie in [0, 1]")
    w_absmax = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0)
    a = act_absmax.float().clamp_min(_FLOOR)
    s = a.pow(alpha) / w_absmax.clamp_min(_FLOOR).pow(1 - alpha)
    return s.clamp(min=_FLOOR, max=1.0 / _FLOOR)


def _outlier_ratio(absmax: torch.Tensor) -> float:
    return float(absmax.max() / absmax.median().clamp_min(_FLOOR))


@torch.no_grad()
def smooth(
    model: nn.Module, windows: list[torch.Tensor], alpha: float = 0.5, folds: list[FoldKind] | tuple = ("qkv", "gate_up")
) -> SmoothResult:
    """Calibrate on ``windows`` and fold SmoothQuant scales into the model in place."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must lie in [0, 1]")
    groups: list[FoldGroup] = fold_groups(model, tuple(folds))
    stats = collect_stats(model, groups, windows)
    before, after, lo, hi = [], [], float("inf"), 0.0
    for g in groups:
        st = stats.get(g.name)
        if st is None:  # an expert no calibration token was routed to: nothing to scale by (s = 1)
            continue
        readers = [model.get_submodule(n).weight for n in g.linears]
        if g.kind == "o":  # one scale per v channel, shared by the o_proj columns that read it
            act = reduce(g, st.absmax)
            w_cols = reduce(g, torch.stack([w.float().abs().amax(0) for w in readers]).amax(0))
            s = (act.clamp_min(_FLOOR).pow(alpha) / w_cols.clamp_min(_FLOOR).pow(1 - alpha)).clamp(_FLOOR, 1 / _FLOOR)
        else:
            act = st.absmax
            s = smooth_scales(act, readers, alpha)
        apply_fold(model, g, s)
        before.append(_outlier_ratio(act))
        after.append(_outlier_ratio(act / s))
        lo, hi = min(lo, float(s.min())), max(hi, float(s.max()))
    return SmoothResult(
        groups=len(groups),
        alpha=alpha,
        outlier_ratio_before=sum(before) / len(before),
        outlier_ratio_after=sum(after) / len(after),
        scale_range=(lo, hi),
    )
