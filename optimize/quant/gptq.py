"""GPTQ (Frantar et al. 2023): choose int4/int8 weights that minimise the layer's output error.

Round-to-nearest rounds every weight on its own. GPTQ quantizes one input column at a time
and moves each column's rounding error onto the columns not yet quantized, weighted by the
inverse Hessian ``H = 2 X^T X`` of the layer's calibration inputs, so the *output* ``X W^T``
stays close even where single weights do not. This module is one layer (or the Linears that
read one input) given its Hessian; :mod:`optimize.quant.gptq_sequential` runs a model block by
block in model order, each block seeing the calibration activations of the blocks already
quantized before it, so errors do not compound unseen; :mod:`optimize.quant.gptq_rows` is the
column loop and its CUDA graphs.

Why not torchao's ``GPTQConfig``: in torchao 0.18 it runs on CUDA only and emits
``Int4Tensor``/``Int8Tensor`` (tinygemm/mslk layouts) that ExecuTorch's XNNPACK partitioner
does not lower. Here the result is torchao's ``IntxUnpackedToInt8Tensor`` built with
``custom_scale`` (the same layout ``ptq_int8`` produces with round-to-nearest), so a GPTQ model
lowers to XNNPACK unchanged: symmetric scales, zero points 0, groups of 32·k input channels.

Group scales are fixed before the error feedback starts ("static groups", from the original
weights by ``max|w|``, HQQ's search, or a clip search), which keeps the groups aligned to XNNPACK's
blocks even when columns are visited in activation order (``act_order``, most-used columns first).
The clip search shrinks each group's ``max|w|`` scale over a grid and keeps the factor with the
lowest error: the weight's own rounding error (``mse``), or the output error on the calibration
inputs, each input column's squared error weighted by ``diag(H) = sum x_j^2`` (``output_mse``,
AWQ's clip search in closed form).

The damping added to ``H`` is a fixed fraction of its mean diagonal, or chosen per layer
(``damp="auto"``): every value of :data:`DAMP_LADDER` runs GPTQ (on a sample of the rows for a
large layer) and the one with the lowest output error against the *undamped* Hessian is kept;
a value whose Cholesky factorisation fails is skipped (and the ladder continues upward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from optimize.quant.fakequant import WeightScheme, qdq_weight, weight_scales
from optimize.quant.gptq_rows import gptq_rows

ScaleInit = Literal["absmax", "hqq", "mse", "output_mse"]
Damp = float | Literal["auto"]

#: the damping fractions ``damp="auto"`` tries per layer; :data:`DAMP_FALLBACK` only when every
#: one of them fails to factorise
DAMP_LADDER = (0.001, 0.003, 0.01, 0.03, 0.1)
DAMP_FALLBACK = (0.3, 0.9)
#: ``damp="auto"`` compares the ladder on at most this many rows of a layer (evenly spaced); a layer
#: with no more rows keeps the winning candidate's integers as they are (no extra pass)
AUTO_DAMP_ROWS = 256


def grid_values(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values ``q * scale`` of some rows: each group of ``in / n_groups`` columns
    times its row's scale for that group (``q`` ``[rows, in]``, ``scale`` ``[rows, n_groups]``)."""
    return (q.float().unflatten(-1, (scale.shape[1], -1)) * scale.float().unsqueeze(-1)).flatten(-2)


@dataclass
class GptqLayerResult:
    """What GPTQ produced for one Linear: integer weights, their scales, and the error it saved."""

    q: torch.Tensor  # int8 storage of the int4/int8 values, [out, in]
    scale: torch.Tensor  # [out, n_groups] (n_groups = 1 for per-channel)
    #: ||X W^T - X Q^T||^2 / ||X W^T||^2 on the calibration inputs (via the Hessian), RTN vs GPTQ
    rel_error_rtn: float
    rel_error_gptq: float
    #: the damping fraction used (the chosen one with ``damp="auto"``)
    damp: float = 0.01

    def dequantized(self) -> torch.Tensor:
        out = torch.empty(self.q.shape, dtype=torch.float32, device=self.q.device)
        self.dequantize_into(out)
        return out

    def dequantize_into(self, out: torch.Tensor, rows: int = 4096) -> None:
        """The float32 values ``q * scale`` written into ``out`` a chunk of rows at a time: no two
        float32 copies of the whole weight (2 GB for a 1B model's 128256-row output head)."""
        for r0 in range(0, self.q.shape[0], rows):
            out[r0 : r0 + rows].copy_(grid_values(self.q[r0 : r0 + rows], self.scale[r0 : r0 + rows]))

    def to(self, device: torch.device) -> "GptqLayerResult":
        return GptqLayerResult(self.q.to(device), self.scale.to(device), self.rel_error_rtn, self.rel_error_gptq,
                               self.damp)


def _mse_scales(w: torch.Tensor, scheme: WeightScheme, grid: int = 20, min_shrink: float = 0.75,
                col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group scales that minimise the rounding error over shrunk ranges: the weight's own
    (``col_weight`` None), or each input column's squared error weighted by ``col_weight``
    (``[in]``; ``diag(H)`` makes it the output error on the calibration inputs, cross terms
    within a group left out). One pass per grid point over all groups at once."""
    base = weight_scales(w, scheme)  # [out, g]
    gs = w.shape[1] // base.shape[1]
    wg = w.float().view(w.shape[0], -1, gs)
    cw = None if col_weight is None else col_weight.float().to(w.device).view(1, -1, gs)
    qmin, qmax = scheme.qrange
    best, best_err = base.clone(), torch.full_like(base, float("inf"), dtype=torch.float64)
    for k in range(grid + 1):
        s = base * (1.0 - (1.0 - min_shrink) * k / grid)
        q = torch.clamp(torch.round(wg / s.unsqueeze(-1)), qmin, qmax)
        sq = (q * s.unsqueeze(-1) - wg).pow(2)
        # summed in float64: an fp32 sum's order follows the CPU's vector path, and near-equal
        # candidates would then be chosen between by the host
        err = (sq if cw is None else sq * cw).double().sum(-1)
        better = err < best_err
        best = torch.where(better, s, best)
        best_err = torch.where(better, err, best_err)
    return best


def initial_scales(w: torch.Tensor, scheme: WeightScheme, how: ScaleInit,
                   col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Group scales from the original weights: torchao's ``max|w|`` rule, HQQ's search, or a clip
    search on the weight's rounding error (``mse``) or on the output error (``output_mse``, which
    needs ``col_weight``: the Hessian's diagonal, ``[in]``)."""
    if how == "mse":
        return _mse_scales(w, scheme)
    if how == "output_mse":
        if col_weight is None or col_weight.shape != (w.shape[1],):
            raise ValueError("scale_init output_mse needs the Hessian's diagonal (one weight per input column)")
        return _mse_scales(w, scheme, col_weight=col_weight)
    algo = "hqq" if how == "hqq" else "rtn"
    return weight_scales(w, WeightScheme(scheme.bits, scheme.group_size, scheme.act_int8, algo))


def _quadratic_error(delta: torch.Tensor, h: torch.Tensor) -> float:
    """``sum_i delta_i^T H delta_i`` = squared output error on the inputs that built ``H``."""
    return float((delta @ h).mul_(delta).sum(dtype=torch.float64))


#: float64 bytes one chunk of rows may hold per working matrix: GPTQ's rows are independent given
#: the Hessian, and a 128256 x 2048 output head in float64 is 2.1 GB a copy (a 1B-class model's
#: ptq_int8 peaked at 22.5 GB RSS on the CPU before rows were chunked). On the CPU a chunk's five
#: or so working matrices are the process's peak RSS, so it takes :data:`CPU_CHUNK_BYTES`; a GPU
#: keeps the larger chunk (fewer eager column loops for an output head)
CHUNK_BYTES = 256 * 2**20
CPU_CHUNK_BYTES = 64 * 2**20


def _check_damp(damp: Damp) -> None:
    if isinstance(damp, str):
        if damp != "auto":
            raise ValueError(f"damp={damp!r} must be a number in (0, 1) or 'auto'")
    elif not 0.0 < damp < 1.0:
        raise ValueError(f"damp={damp} must lie in (0, 1)")


def _inverse_factor(h: torch.Tensor, damp: float, *, consume: bool = False) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1``; raises LinAlgError if not PD.

    One step at a time, each intermediate freed before the next, and with ``consume`` the damping
    added to ``h`` itself (the caller's to give up): an 8192-input Linear's Hessian is 512 MiB in
    float64, and the one-expression form held five such matrices at once (the peak RSS of a
    1B-class model's ``ptq_int8`` on the CPU)."""
    hd = h if consume else h.clone()
    hd.diagonal().add_(damp * torch.mean(torch.diag(h)))
    del h
    factor = torch.linalg.cholesky(hd)
    del hd
    inverse = torch.cholesky_inverse(factor)
    del factor
    hinv = torch.linalg.cholesky(inverse, upper=True)
    del inverse
    if not bool(torch.isfinite(hinv).all()):
        raise torch.linalg.LinAlgError("non-finite inverse Hessian factor")
    return hinv


@torch.no_grad()
def gptq_layer(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: WeightScheme,
    *,
    damp: Damp = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    scale_init: ScaleInit = "absmax",
    rows_per_chunk: int | None = None,
    damp_ladder: tuple[float, ...] = DAMP_LADDER,
) -> GptqLayerResult:
    """Quantize one ``[out, in]`` weight with GPTQ against ``hessian`` (``[in, in]``, ``sum x x^T``).

    The Hessian's inverse is factored once; the rows then go through GPTQ a chunk at a time
    (``rows_per_chunk``, default: :data:`CHUNK_BYTES` of float64 per working matrix), which gives
    the same integers as all rows at once, with a bounded working set.

    ``damp="auto"`` tries every fraction of ``damp_ladder`` (the module docstring) and keeps the
    one whose GPTQ output error on the undamped Hessian is lowest; the result's ``damp`` says which."""
    return gptq_layers([weight], hessian, scheme, damp=damp, block_size=block_size, act_order=act_order,
                       scale_init=scale_init, rows_per_chunk=rows_per_chunk, damp_ladder=damp_ladder)[0]


@torch.no_grad()
def gptq_layers(
    weights: list[torch.Tensor],
    hessian: torch.Tensor,
    scheme: WeightScheme,
    *,
    damp: Damp = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    scale_init: ScaleInit = "absmax",
    rows_per_chunk: int | None = None,
    damp_ladder: tuple[float, ...] = DAMP_LADDER,
    consume_hessian: bool = False,
) -> list[GptqLayerResult]:
    """:func:`gptq_layer` for Linears that read the same input (q/k/v, gate/up): one Hessian, one
    inverse factor, and their rows stacked through one column loop. Why: GPTQ's rows are
    independent given the Hessian and each row's scales, so stacking gives each layer the integers
    it gets alone, with one column loop instead of one per layer (the loop's per-column steps
    are what a GPU spends its time on). Each result carries its own layer's errors.

    ``damp="auto"`` chooses per layer, so there each weight runs on its own. ``consume_hessian``:
    the caller gives a float64 ``hessian`` up, and it is changed in place instead of copied (512 MiB
    for an 8192-input Linear)."""
    if not weights:
        raise ValueError("gptq_layers needs at least one weight")
    _check_damp(damp)
    for weight in weights:
        if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
            raise ValueError(f"weight {tuple(weight.shape)} and hessian {tuple(hessian.shape)} do not match")
    if damp == "auto" and len(weights) > 1:
        return [gptq_layer(w, hessian, scheme, damp=damp, block_size=block_size, act_order=act_order,
                           scale_init=scale_init, rows_per_chunk=rows_per_chunk, damp_ladder=damp_ladder)
                for w in weights]
    in_f = weights[0].shape[1]
    gs = scheme.group_size or in_f
    if in_f % gs:
        raise ValueError(f"group_size={gs} does not divide in_features={in_f}")

    if hessian.dtype != torch.float64:
        h_ref = hessian.detach().double()  # a new tensor already
    else:
        h_ref = hessian.detach() if consume_hessian else hessian.detach().clone()
    del hessian
    col_weight = torch.diag(h_ref).clamp_min(0.0).float() if scale_init == "output_mse" else None
    dead = torch.diag(h_ref) == 0
    h_ref[dead, dead] = 1.0  # the undamped Hessian the errors are measured on
    perm = torch.argsort(torch.diag(h_ref), descending=True) if act_order else torch.arange(in_f, device=h_ref.device)
    inv_perm = torch.argsort(perm)

    def permuted() -> torch.Tensor:  # one gather, no intermediate copy
        return h_ref[perm.unsqueeze(1), perm]

    def scales_of(w_orig: torch.Tensor) -> torch.Tensor:
        return initial_scales(w_orig, scheme, scale_init, col_weight)

    done = None  # (q, scale) of every row when the ladder already ran on all of them
    if damp == "auto":
        damp, hinv, done = _auto_damp(weights[0], permuted(), h_ref, scheme, dead, perm, inv_perm, gs, block_size,
                                      scales_of, damp_ladder)
    else:
        try:
            hinv = _inverse_factor(permuted(), damp, consume=True)
        except torch.linalg.LinAlgError as exc:  # pragma: no cover - damp makes H positive definite in practice
            raise ValueError(f"GPTQ: the Hessian is not positive definite even with damp={damp}; raise damp "
                             "(or use damp: auto)") from exc

    chunk = CHUNK_BYTES if weights[0].is_cuda else min(CHUNK_BYTES, CPU_CHUNK_BYTES)
    rows = rows_per_chunk or max(1, chunk // (in_f * 8))
    stacked = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
    if done is not None:
        q_all, scale_all = done[0].to(torch.int8), done[1].float()
    else:  # filled a chunk at a time: no list of chunks beside the whole (a 1B model's head: 250 MiB each)
        q_all = torch.empty(stacked.shape, dtype=torch.int8, device=stacked.device)
        scale_all = torch.empty((stacked.shape[0], in_f // gs), dtype=torch.float32, device=stacked.device)
        for r0 in range(0, stacked.shape[0], rows):
            w_orig = stacked[r0 : r0 + rows].float()
            scale = scales_of(w_orig)
            q_all[r0 : r0 + rows] = gptq_rows(w_orig, scheme, hinv.unsqueeze(0), dead, perm, inv_perm, gs,
                                               block_size, scale)[0]
            scale_all[r0 : r0 + rows] = scale
            del w_orig
    del stacked
    results, r0 = [], 0
    for weight in weights:
        r1 = r0 + weight.shape[0]
        q, scale = q_all[r0:r1], scale_all[r0:r1]
        if len(weights) > 1:  # each layer's own storage: an installed layer then holds its rows, not the stack's
            q, scale = q.clone(), scale.clone()
        rtn, gptq = _relative_errors(weight, q, scale, scheme, h_ref, rows)
        results.append(GptqLayerResult(q=q, scale=scale, rel_error_rtn=rtn, rel_error_gptq=gptq, damp=float(damp)))
        r0 = r1
    del q_all, scale_all
    return results


def _relative_errors(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme,
                     h_ref: torch.Tensor, rows: int) -> tuple[float, float]:
    """Round-to-nearest's and GPTQ's output error relative to the output, on the undamped Hessian
    (what the calibration inputs actually see), a chunk of rows at a time."""
    gs = weight.shape[1] // scale.shape[1]
    ref = err_rtn = err_gptq = 0.0
    # figures for the report, nothing decides on them: the differences are formed in float64 and
    # multiplied in float32 (in float64 these products were a quarter of GPTQ's solve time)
    h32 = h_ref.float()
    for r0 in range(0, weight.shape[0], rows):  # differences formed in place: two float64 chunks at a time
        w_orig = weight.detach()[r0 : r0 + rows].float()
        w64 = w_orig.double()
        ref += _quadratic_error(w_orig, h32)
        delta = q[r0 : r0 + rows].double().view(w64.shape[0], -1, gs)
        delta.mul_(scale[r0 : r0 + rows].double().unsqueeze(-1))
        err_gptq += _quadratic_error(delta.view(w64.shape).sub_(w64).float(), h32)
        delta = qdq_weight(w_orig, WeightScheme(scheme.bits, scheme.group_size, scheme.act_int8)).double()
        del w_orig
        err_rtn += _quadratic_error(delta.sub_(w64).float(), h32)
        del delta, w64
    del h32
    denom = max(ref, 1e-30)
    return err_rtn / denom, err_gptq / denom


def _auto_damp(weight: torch.Tensor, h: torch.Tensor, h_ref: torch.Tensor, scheme: WeightScheme,
               dead: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor, gs: int, block_size: int,
               scales_of: Callable[[torch.Tensor], torch.Tensor], ladder: tuple[float, ...],
               ) -> tuple[float, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``damp="auto"``: GPTQ with every damping fraction of ``ladder`` on (a sample of) the rows,
    all candidates in one column loop; returns the damp with the lowest output error on ``h_ref``,
    its inverse factor, and (q, scale) of every row when the sample was every row.

    ``h`` is the permuted, undamped Hessian. Fractions whose factorisation fails are skipped; if all
    do, :data:`DAMP_FALLBACK` is tried. Memory: the candidates' inverse factors go a group at a
    time (:data:`CHUNK_BYTES`), the sample holds at most :data:`AUTO_DAMP_ROWS` rows and
    :data:`CHUNK_BYTES` per working matrix across the candidates of a group."""
    out_f, in_f = weight.shape
    per_group = max(1, min(len(ladder), CHUNK_BYTES // (in_f * in_f * 8)))
    n = max(1, min(out_f, AUTO_DAMP_ROWS, CHUNK_BYTES // (per_group * in_f * 8)))
    idx = None if n == out_f else (torch.arange(n, device=weight.device) * out_f) // n  # evenly spaced rows
    w_s = (weight.detach() if idx is None else weight.detach()[idx]).float()
    scale = scales_of(w_s)
    w64 = w_s.double()
    best: tuple[float, float, torch.Tensor, torch.Tensor] | None = None  # (error, damp, hinv, q)
    for candidates in (tuple(ladder), DAMP_FALLBACK):
        for g0 in range(0, len(candidates), per_group):
            ok, hinvs = [], []
            for d in candidates[g0 : g0 + per_group]:
                try:
                    hinvs.append(_inverse_factor(h, d))
                    ok.append(d)
                except torch.linalg.LinAlgError:
                    continue
            if not ok:
                continue
            qc = gptq_rows(w_s, scheme, torch.stack(hinvs), dead, perm, inv_perm, gs, block_size, scale)
            dq_scale = scale.double().repeat_interleave(gs, dim=1)
            for d, hinv, q in zip(ok, hinvs, qc):
                err = _quadratic_error(q * dq_scale - w64, h_ref)
                if best is None or err < best[0]:
                    best = (err, d, hinv, q)
            del qc, hinvs
        if best is not None:
            break
    if best is None:
        raise ValueError(f"GPTQ: the Hessian is not positive definite with any damp in {ladder + DAMP_FALLBACK}")
    _, d, hinv, q = best
    return d, hinv, ((q, scale) if idx is None else None)
