"""Activation-aware weight scaling (AWQ, Lin et al. 2024), folded exactly into the model.

For each equalization group (see :mod:`optimize.quant.equalize`) the input channels that
carry large activations are scaled up in the weights (``s = mean|X| ** alpha``), so 4-bit
rounding hurts them less, and the inverse is folded into the preceding norm or linear. The
exponent is chosen per group on calibration rows by the error of the group's fake-quantized
outputs (with the shipped scheme's per-token activation quantization). ``alpha = 0`` is
plain round-to-nearest, so the search never does worse than RTN on the calibration rows.

Unlike torchao's ``AWQConfig`` (which keeps ``1/s`` as an ``act_pre_scale`` multiply at run
time), the fold leaves ordinary fp32 weights: any later stage (``ptq_int8`` with
round-to-nearest or HQQ scales) quantizes them, and the .pte lowers to XNNPACK unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from optimize.quant.equalize import FoldGroup, FoldKind, apply_fold, collect_stats, expand, fold_groups, reduce
from optimize.quant.fakequant import WeightScheme, qdq_act, qdq_weight

DEFAULT_GRID = tuple(i / 10 for i in range(11))


@dataclass
class AwqResult:
    groups: int
    #: group name -> chosen alpha
    alphas: dict[str, float] = field(default_factory=dict)
    #: summed squared output error over all groups, RTN (alpha=0) vs chosen
    error_rtn: float = 0.0
    error_awq: float = 0.0

    @property
    def error_reduction(self) -> float:
        return 1.0 - self.error_awq / self.error_rtn if self.error_rtn > 0 else 0.0


def _group_error(
    x: torch.Tensor, weights: list[torch.Tensor], s_cols: torch.Tensor, scheme: WeightScheme,
    refs: list[torch.Tensor] | None = None,
) -> float:
    """Squared error of the readers' outputs when weights*s are quantized and inputs are x/s."""
    xs = x / s_cols
    xs = qdq_act(xs, scheme)
    err = 0.0
    for i, w in enumerate(weights):
        ref = refs[i] if refs is not None else x @ w.t()
        out = xs @ qdq_weight(w * s_cols, scheme).t()
        err += float((out - ref).double().pow(2).sum())  # float64: the same sum (and choice) on every CPU path
    return err


#: relative error difference below which two exponents count as equally good (see search_group)
TIE = 1e-6
#: scales are powers of two in steps of 1/SNAP octave (see search_group)
SNAP = 4096


@torch.no_grad()
def search_group(
    x: torch.Tensor, weights: list[torch.Tensor], g: FoldGroup, absmean: torch.Tensor, scheme: WeightScheme,
    grid: tuple[float, ...] = DEFAULT_GRID,
) -> tuple[float, torch.Tensor, float, float]:
    """Best exponent for one group: returns ``(alpha, scales per source channel, err_rtn, err_best)``."""
    base = reduce(g, absmean.double()).clamp_min(1e-6)
    err_rtn = float("nan")
    refs = [x @ w.t() for w in weights]
    tried = []
    for alpha in grid:
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (AWQ's normalisation)
        # snapped to 2^(k/4096) (0.02% steps), in float64: the activation statistics carry the CPU
        # path's last bits, and a scale one fp32 ulp apart would move the folded weights and every
        # rounding decision after them; a snapped scale almost never lands on the other side
        s = torch.exp2(torch.round(torch.log2(s) * SNAP) / SNAP).float()
        err = _group_error(x, weights, expand(g, s), scheme, refs)
        if alpha == 0.0:
            err_rtn = err
        tried.append((alpha, s, err))
    # the first exponent within TIE of the lowest error: two exponents whose errors differ only by
    # the host's rounding must not be chosen between by it (the choice moves every later weight)
    lowest = min(e for _, _, e in tried)
    best = next(t for t in tried if t[2] <= lowest * (1 + TIE))
    if err_rtn != err_rtn:  # grid without 0: measure RTN for the report
        err_rtn = _group_error(x, weights, x.new_ones(x.shape[1]), scheme, refs)
    return best[0], best[1], err_rtn, best[2]


@torch.no_grad()
def awq_scale(
    model: nn.Module,
    windows: list[torch.Tensor],
    scheme: WeightScheme,
    folds: list[FoldKind] | tuple = ("qkv", "gate_up", "down", "o"),
    rows: int = 512,
    grid: tuple[float, ...] = DEFAULT_GRID,
    skip: set[str] | frozenset = frozenset(),
) -> AwqResult:
    """Search and fold AWQ scales in place for every group whose readers will be quantized.

    ``skip`` names Linear modules that stay unquantized (kept high precision); a group all of
    whose readers are skipped is left alone.
    """
    if rows < 16:
        raise ValueError(f"rows={rows}: the search needs at least 16 calibration rows per group")
    groups = [g for g in fold_groups(model, tuple(folds)) if not all(n in skip for n in g.linears)]
    stats = collect_stats(model, groups, windows, keep_tokens=rows)
    result = AwqResult(groups=len(groups))
    for g in groups:
        st = stats.get(g.name)
        if st is None:  # an expert no calibration token was routed to: nothing to scale by (s = 1)
            continue
        x = torch.cat(st.samples)[:rows]
        weights = [model.get_submodule(n).weight.detach().float() for n in g.linears if n not in skip]
        alpha, s, e0, e1 = search_group(x, weights, g, st.absmean, scheme, grid)
        result.alphas[g.name] = alpha
        result.error_rtn += e0
        result.error_awq += e1
        if alpha != 0.0:
            apply_fold(model, g, s)
    return result


def linear_error(x: torch.Tensor, w: torch.Tensor, scheme: WeightScheme) -> float:
    """Relative output error of one fake-quantized Linear on rows ``x`` (for tests and reports)."""
    ref = x @ w.t()
    xs = qdq_act(x, scheme)
    return float((F.linear(xs, qdq_weight(w, scheme)) - ref).pow(2).sum() / ref.pow(2).sum())
