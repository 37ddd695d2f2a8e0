"""GPTQ (Frantar et al. 2023): choose int4/int8 weights that minimise the layer's output error.

Round-to-nearest rounds every weight on its own. GPTQ quantizes one input column at a time
and moves each column's rounding error onto the columns not yet quantized, weighted by the
inverse Hessian ``H = 2 X^T X`` of the layer's calibration inputs, so the *output* ``X W^T``
stays close even where single weights do not. Layers are processed block by block in model
order, each seeing the calibration activations of the blocks already quantized before it
(sequential GPTQ), so errors do not compound unseen.

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

import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import nn

from optimize.device import model_device, on_device
from optimize.quant.block_inputs import BlockChain
from optimize.quant.fakequant import WeightScheme, qdq_act, qdq_weight, weight_scales
from optimize.quant.host_independent import computing_in
from train.model_parts import block_of, decoder_blocks

ScaleInit = Literal["absmax", "hqq", "mse", "output_mse"]
Damp = float | Literal["auto"]

#: the damping fractions ``damp="auto"`` tries per layer; :data:`DAMP_FALLBACK` only when every
#: one of them fails to factorise
DAMP_LADDER = (0.001, 0.003, 0.01, 0.03, 0.1)
DAMP_FALLBACK = (0.3, 0.9)
#: ``damp="auto"`` compares the ladder on at most this many rows of a layer (evenly spaced); a layer
#: with no more rows keeps the winning candidate's integers as they are (no extra pass)
AUTO_DAMP_ROWS = 256


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
        gs = self.q.shape[1] // self.scale.shape[1]
        for r0 in range(0, self.q.shape[0], rows):
            q = self.q[r0 : r0 + rows]
            out[r0 : r0 + rows].copy_((q.float().view(q.shape[0], -1, gs)
                                       * self.scale[r0 : r0 + rows].unsqueeze(-1)).view(q.shape))

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
    return float((delta @ h).mul_(delta).sum())


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
            q_all[r0 : r0 + rows] = _gptq_rows(w_orig, scheme, hinv.unsqueeze(0), dead, perm, inv_perm, gs,
                                               block_size, scale)[0]
            scale_all[r0 : r0 + rows] = scale
            del w_orig
    del stacked
    results, r0 = [], 0
    for weight in weights:
        r1 = r0 + weight.shape[0]
        q, scale = q_all[r0:r1], scale_all[r0:r1]
        rtn, gptq = _relative_errors(weight, q, scale, scheme, h_ref, rows)
        results.append(GptqLayerResult(q=q, scale=scale, rel_error_rtn=rtn, rel_error_gptq=gptq, damp=float(damp)))
        r0 = r1
    return results


def _relative_errors(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme,
                     h_ref: torch.Tensor, rows: int) -> tuple[float, float]:
    """Round-to-nearest's and GPTQ's output error relative to the output, on the undamped Hessian
    (what the calibration inputs actually see), a chunk of rows at a time."""
    gs = weight.shape[1] // scale.shape[1]
    ref = err_rtn = err_gptq = 0.0
    for r0 in range(0, weight.shape[0], rows):  # differences formed in place: two float64 chunks at a time
        w_orig = weight.detach()[r0 : r0 + rows].float()
        w64 = w_orig.double()
        ref += _quadratic_error(w64, h_ref)
        delta = q[r0 : r0 + rows].double().view(w64.shape[0], -1, gs)
        delta.mul_(scale[r0 : r0 + rows].double().unsqueeze(-1))
        err_gptq += _quadratic_error(delta.view(w64.shape).sub_(w64), h_ref)
        delta = qdq_weight(w_orig, WeightScheme(scheme.bits, scheme.group_size, scheme.act_int8)).double()
        del w_orig
        err_rtn += _quadratic_error(delta.sub_(w64), h_ref)
        del delta, w64
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
            qc = _gptq_rows(w_s, scheme, torch.stack(hinvs), dead, perm, inv_perm, gs, block_size, scale)
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


def _gptq_rows(w_orig: torch.Tensor, scheme: WeightScheme, hinv: torch.Tensor, dead: torch.Tensor,
               perm: torch.Tensor, inv_perm: torch.Tensor, gs: int, block_size: int,
               scale: torch.Tensor) -> torch.Tensor:
    """GPTQ's column loop over some rows of the weight, once per inverse factor in ``hinv``
    (``[C, in, in]``, permuted; candidates of ``damp="auto"`` share one loop): the integers as
    float64 in input order, ``[C, rows, in]``. ``scale`` (``[rows, n_groups]``) is fixed.

    On CUDA, inside :func:`gptq_model`, the loop replays as a CUDA graph (:class:`RowGraphs`)."""
    args = (w_orig, hinv, dead, perm, inv_perm, scale)
    statics = (scheme.qrange, gs, block_size)
    if _ROW_GRAPHS is not None and _ROW_GRAPHS.wants(w_orig, hinv):
        return _ROW_GRAPHS.run(args, statics)
    return _column_loop(*args, *statics)


def _column_loop(w_orig: torch.Tensor, hinv: torch.Tensor, dead: torch.Tensor, perm: torch.Tensor,
                 inv_perm: torch.Tensor, scale: torch.Tensor, qrange: tuple[int, int], gs: int,
                 block_size: int) -> torch.Tensor:
    """:func:`_gptq_rows`'s arithmetic, with no host synchronisation and no data-dependent shape
    (masks by ``masked_fill``, group scales by ``expand``), so that a CUDA graph can capture it."""
    qmin, qmax = qrange
    n_c, in_f = hinv.shape[0], w_orig.shape[1]
    w = w_orig.double()[:, perm].masked_fill_(dead[perm], 0.0)  # one float64 copy, in GPTQ's column order
    w = w.unsqueeze(0) if n_c == 1 else w.unsqueeze(0).repeat(n_c, 1, 1)  # [C, rows, in]
    scale64 = scale.double()
    col_scale = scale64.unsqueeze(-1).expand(*scale64.shape, gs).reshape(scale64.shape[0], -1)[:, perm]
    q = torch.zeros_like(w)
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, :, i]
            s = col_scale[:, i1 + i]
            qi = torch.clamp(torch.round(col / s), qmin, qmax)
            q[:, :, i1 + i] = qi
            e = (col - qi * s) / hinv1[:, i, i].unsqueeze(1)
            w1[:, :, i:] -= e.unsqueeze(2) * hinv1[:, i, i:].unsqueeze(1)
            err1[:, :, i] = e
        for c in range(n_c):  # one 2-D product per candidate: the same float path as a single one
            w[c, :, i2:] -= err1[c] @ hinv[c, i1:i2, i2:]
    return q[:, :, inv_perm]


class RowGraphs:
    """GPTQ's column loop as CUDA graphs, one per shape, replayed for every layer of that shape.

    Why: the loop launches about ten small kernels per input column (a 135M model has 150k
    columns over its Linears); on a GPU each launch's host-side cost outweighs its work, and a
    graph replays the whole loop with one launch. Layers of one model repeat a handful of shapes,
    so each graph is captured once and replayed per block.

    Exactness is checked, not assumed: the first replay of every graph is compared with the eager
    loop on the same inputs, and any difference (or a failed capture) turns graphs off for the
    rest of the run, which then computes eagerly. Large layers (an output head) run eagerly:
    there the kernels' own work dominates and a graph's private memory would be large."""

    #: working-matrix elements (candidates x rows x in) above which the loop runs eagerly
    MAX_ELEMENTS = 2**23
    #: graphs kept at once (each holds its own memory pool)
    MAX_GRAPHS = 16

    def __init__(self) -> None:
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph, static inputs, static output, replays)
        self.disabled: str | None = None
        self.captured = self.replayed = 0

    def wants(self, w_orig: torch.Tensor, hinv: torch.Tensor) -> bool:
        return (self.disabled is None and w_orig.is_cuda and hinv.is_cuda
                and hinv.shape[0] * w_orig.numel() <= self.MAX_ELEMENTS)

    def run(self, args: tuple[torch.Tensor, ...], statics: tuple) -> torch.Tensor:
        key = (statics, tuple((tuple(a.shape), a.dtype, a.device) for a in args))
        entry = self.graphs.get(key)
        if entry is None:
            return self._capture(key, args, statics)
        graph, static_in, static_out, replays = entry
        for dst, src in zip(static_in, args):
            dst.copy_(src)
        graph.replay()
        out = static_out.clone()
        self.replayed += 1
        if replays == 0:  # the first replay: proven against the eager loop once per graph
            eager = _column_loop(*args, *statics)
            if not torch.equal(out, eager):
                self._off("a replay differed from the eager loop")
                return eager
        self.graphs[key] = (graph, static_in, static_out, replays + 1)
        return out

    def _capture(self, key: tuple, args: tuple[torch.Tensor, ...], statics: tuple) -> torch.Tensor:
        if len(self.graphs) >= self.MAX_GRAPHS:
            self.graphs.clear()
        static_in = tuple(a.clone() for a in args)
        stream = torch.cuda.Stream(device=args[0].device)
        stream.wait_stream(torch.cuda.current_stream(args[0].device))
        with torch.cuda.stream(stream):  # warm-up off the capture (cuBLAS workspaces); its result is this call's
            out = _column_loop(*static_in, *statics)
        torch.cuda.current_stream(args[0].device).wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = _column_loop(*static_in, *statics)
        except Exception as exc:  # noqa: BLE001 - any capture failure: compute eagerly from here on
            self._off(f"capture failed: {type(exc).__name__}: {str(exc)[:200]}")
            return out
        self.graphs[key] = (graph, static_in, static_out, 0)
        self.captured += 1
        return out

    def _off(self, why: str) -> None:
        self.disabled = why
        self.graphs.clear()

    def summary(self) -> dict:
        return {"captured": self.captured, "replayed": self.replayed, "disabled": self.disabled}


#: the graphs of the :func:`gptq_model` run in progress (None: the column loop runs eagerly)
_ROW_GRAPHS: RowGraphs | None = None


class HessianCollector:
    """Accumulates ``sum x x^T`` over the inputs a set of Linears receive (one Hessian per input)."""

    def __init__(self, model: nn.Module, names: list[str], scheme: WeightScheme | None = None):
        self.model, self.scheme = model, scheme
        self.h: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        # q/k/v (and gate/up) receive the very same input tensor one after another: its x^T x is
        # computed once and reused while that tensor is unchanged
        self._last: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._handles = [model.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in names]

    def _outer(self, inp: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is not None and last[0] is inp and last[1] == inp._version:
            return last[2]
        x = inp.detach()
        x = (x if x.dtype == torch.float64 else x.float()).reshape(-1, inp.shape[-1])  # float64 calibration stays so
        if self.scheme is not None:  # the int8 activations the shipped kernel multiplies
            x = qdq_act(x, self.scheme)
        x = x.double()
        xtx = x.t() @ x
        self._last = (inp, inp._version, xtx)
        return xtx

    def _hook(self, name: str) -> Callable:
        def fn(_mod, args):
            xtx = self._outer(args[0])
            if name not in self.h:
                self.h[name] = torch.zeros_like(xtx)
                self.tokens[name] = 0
            self.h[name] += xtx
            self.tokens[name] += args[0].numel() // args[0].shape[-1]

        return fn

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._last = None


class _StopForward(Exception):
    pass


def _untie(model: nn.Module, names: list[str]) -> None:
    """Give each target Linear its own weight if it shares one (a tied lm_head shares the embedding)."""
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    for n in names:
        lin = model.get_submodule(n)
        if owners.get(id(lin.weight), 0) > 1:
            lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=lin.weight.requires_grad)


@dataclass
class GptqRunResult:
    layers: dict[str, GptqLayerResult] = field(default_factory=dict)
    tokens: int = 0
    #: the blocks (or "outside blocks") calibrated, in order
    steps: list[str] = field(default_factory=list)
    #: seconds in the calibration forwards (Hessians) and in GPTQ's solves, summed over the blocks
    calibrate_s: float = 0.0
    solve_s: float = 0.0
    #: :meth:`RowGraphs.summary` where the column loop ran as CUDA graphs
    cuda_graphs: dict | None = None

    def summary(self) -> dict:
        rtn = [r.rel_error_rtn for r in self.layers.values()]
        gq = [r.rel_error_gptq for r in self.layers.values()]
        n = max(len(rtn), 1)
        return {
            "layers": len(self.layers),
            "calibration_tokens": self.tokens,
            "mean_rel_output_error_rtn": round(sum(rtn) / n, 6),
            "mean_rel_output_error_gptq": round(sum(gq) / n, 6),
            "output_error_reduction": round(1.0 - sum(gq) / max(sum(rtn), 1e-30), 4),
            "damp_counts": _counts(r.damp for r in self.layers.values()),
            "damp_by_projection": {kind: _counts(r.damp for n, r in self.layers.items() if n.rsplit(".", 1)[-1] == kind)
                                   for kind in sorted({n.rsplit(".", 1)[-1] for n in self.layers})},
        }

    def timing(self) -> dict:
        """Where the run's time went (apart from :meth:`summary`, whose figures repeat run to run)."""
        return {"calibrate_s": round(self.calibrate_s, 2), "solve_s": round(self.solve_s, 2),
                **({"cuda_graphs": self.cuda_graphs} if self.cuda_graphs else {})}


def shared_input_groups(names: list[str], hessians: dict[str, torch.Tensor],
                        targets: dict[str, WeightScheme]) -> list[list[str]]:
    """``names`` grouped by identical Hessian and scheme, in first-seen order: the Linears that
    read one input (q/k/v, gate/up) accumulated the very same ``x^T x`` sums, so equality is exact."""
    groups: list[list[str]] = []
    for name in names:
        for group in groups:
            first = group[0]
            if targets[first] == targets[name] and torch.equal(hessians[first], hessians[name]):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work (CUDA runs ahead of the host)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _counts(values) -> dict[str, int]:
    """How many layers used each damping fraction, smallest first (keys as ``f"{d:g}"``)."""
    out: dict[float, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return {f"{k:g}": out[k] for k in sorted(out)}


@torch.no_grad()
def gptq_model(
    model: nn.Module,
    targets: dict[str, WeightScheme],
    windows: list[torch.Tensor],
    *,
    damp: Damp = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    scale_init: ScaleInit = "absmax",
    log: Callable[[str], None] | None = None,
    device: torch.device | None = None,
    progress: Callable[..., None] | None = None,
    calibration_dtype: torch.dtype | None = None,
) -> GptqRunResult:
    """Sequential GPTQ over the named Linears, with the calibration forward in ``calibration_dtype``.

    ``calibration_dtype`` (e.g. float64): the model is cast to it for the calibration forwards
    and back to its own dtype afterwards (both casts exact: fp32/bf16 values are float64 values,
    and the installed weights are GPTQ's grid values). Why: in fp32 the activations that build the
    Hessians differ in their last bits between the CPU's vector paths (``ATEN_CPU_CAPABILITY``
    default/avx2/avx512), GPTQ's rounding decisions follow them, and 19% of SmolLM2's int4 weights
    (its first six blocks) came out different between two paths of one machine; with the forward
    in float64, none did (:mod:`optimize.quant.host_independent`). See :func:`_gptq_model` for the
    algorithm.
    """
    global _ROW_GRAPHS
    graphs = _ROW_GRAPHS = RowGraphs()
    try:
        with computing_in(model, calibration_dtype):
            result = _gptq_model(model, targets, windows, damp=damp, block_size=block_size, act_order=act_order,
                                 scale_init=scale_init, log=log, device=device, progress=progress)
    finally:
        _ROW_GRAPHS = None
        graphs.graphs.clear()
    if graphs.captured or graphs.disabled:
        result.cuda_graphs = graphs.summary()
    return result


def _gptq_model(
    model: nn.Module,
    targets: dict[str, WeightScheme],
    windows: list[torch.Tensor],
    *,
    damp: Damp = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    scale_init: ScaleInit = "absmax",
    log: Callable[[str], None] | None = None,
    device: torch.device | None = None,
    progress: Callable[..., None] | None = None,
) -> GptqRunResult:
    """Sequential GPTQ over the named Linears (name -> scheme), block by block in model order.

    Each decoder block calibrates on what the blocks before it, already quantized, output for
    the calibration windows (cached between blocks by
    :class:`~optimize.quant.block_inputs.BlockChain`, so each block runs twice per window: once
    to calibrate, once quantized to feed the next; the head then reads the chain's last outputs;
    models whose blocks do not simply feed each other run the model prefix again for every
    block, as before); the block's Linears are then quantized from the
    Hessians of the inputs they received, and their fp32 weights replaced by the de-quantized
    GPTQ values (exactly on the grid), so later blocks calibrate on what the quantized model
    computes. Linears outside the decoder blocks (``lm_head``) come last.
    The caller turns the returned integers and scales into its runtime's tensors.

    ``device`` is where the blocks compute. With the chain, a model kept elsewhere (a large model
    on the CPU, the GPU as ``device``) has one decoder block at a time moved there, together
    with the carried hidden states, and back once it is quantized; what lies outside the blocks
    (and the slower path without the chain) runs where the model is. None, or the model's own
    device: everything runs where the model is. The windows are moved to the model.
    """
    if not windows:
        raise ValueError("GPTQ needs calibration windows (ctx.calibration is empty)")
    home = model_device(model)
    windows = [w.to(home) for w in windows]
    blocks = [name for name, _ in decoder_blocks(model)]
    _untie(model, list(targets))
    stages: dict[str | None, list[str]] = {}
    for name in targets:
        stages.setdefault(block_of(name, blocks), []).append(name)
    order = [b for b in blocks if b in stages] + ([None] if None in stages else [])
    result = GptqRunResult()

    def calibrate_and_quantize(names: list[str], feed: Callable[[], None], label: str) -> None:
        """Feed the windows with Hessian hooks on ``names``, then GPTQ them."""
        t_feed = _clock(device or home)
        collector = HessianCollector(model, names, targets[names[0]] if targets[names[0]].act_int8 else None)
        try:
            feed()
        finally:
            collector.close()
        result.tokens = max(result.tokens, max(collector.tokens.values(), default=0))
        for name in names:
            if name not in collector.h:
                raise ValueError(f"GPTQ: {name} received no input during calibration (is it used in forward?)")
        t0 = _clock(device or home)
        result.calibrate_s += t0 - t_feed
        # GPTQ each group of Linears that read one input (q/k/v, gate/up) from its Hessian; install
        # the de-quantized grid values
        for group in shared_input_groups(names, collector.h, targets):
            lins = [model.get_submodule(name) for name in group]
            hessian = collector.h.pop(group[0])
            for name in group[1:]:
                del collector.h[name]
            outs = gptq_layers([lin.weight for lin in lins], hessian, targets[group[0]], damp=damp,
                               block_size=block_size, act_order=act_order, scale_init=scale_init,
                               consume_hessian=damp != "auto")
            del hessian
            for name, lin, res in zip(group, lins, outs):
                res.dequantize_into(lin.weight.data)
                result.layers[name] = res.to(home)  # kept beside the model, not on the block's compute device
        result.solve_s += _clock(device or home) - t0
        if log:
            log(f"gptq {len(result.steps) + 1}/{len(order)} {label}: {len(names)} layers")
        if progress:  # a bar (step = block) on a terminal, an event for a run_pipeline callback
            progress(len(result.steps) + 1, len(order), phase="gptq", message=str(label), layers=len(names))
        result.steps.append(label)

    chain = BlockChain.capture(model, blocks, windows) if blocks and any(b is not None for b in order) else None
    if chain is not None and not chain.ok:
        if log:
            log(f"gptq: {chain.why}; calibrating each block from the model's input instead (slower)")
        chain = None
    rest = order
    if chain is not None:
        # each block calibrates on the cached outputs of the (already quantized) blocks before it:
        # two forwards of that block per window instead of a forward through every earlier block
        outside = None in stages
        chain.to(device or home)
        for i, block in enumerate(blocks):
            with on_device(chain.mods[i], device):
                if block in stages:
                    calibrate_and_quantize(stages[block], lambda i=i: chain.run_block(i), block)
                if i < len(blocks) - 1 or outside:
                    chain.advance(i)
        if outside:
            # the Linears outside the blocks (lm_head) read what the quantized blocks output: the
            # blocks answer from the chain, so only the embedding, final norm and head run again
            def feed_from_chain():
                for j, w in enumerate(windows):
                    with chain.replay(j):
                        model(w.view(1, -1), use_cache=False)

            calibrate_and_quantize(stages[None], feed_from_chain, "outside blocks")
        rest = []
    for block in rest:
        stop = None
        if block is not None and block != blocks[-1]:
            def _halt(_m, _a, _o):
                raise _StopForward
            stop = model.get_submodule(block).register_forward_hook(_halt)

        def feed_from_input():
            for w in windows:
                try:
                    model(w.view(1, -1))
                except _StopForward:
                    pass

        try:
            calibrate_and_quantize(stages[block], feed_from_input, block or "outside blocks")
        finally:
            if stop is not None:
                stop.remove()
    return result
