"""GPTQ's column loop over a chunk of a weight's rows, and its replay as CUDA graphs.

The loop is the algorithm's inner arithmetic: :mod:`optimize.quant.gptq` prepares the inverse
Hessian factor, the column order and the fixed group scales, and calls :func:`gptq_rows` a chunk
of rows at a time. The loop has no host synchronisation and no data-dependent shape, so on CUDA
one model's run (:func:`row_graphs`, opened by
:func:`~optimize.quant.gptq_sequential.gptq_model`) captures it once per layer shape and replays
it for every block; the first replay of each graph is checked against the eager loop.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from optimize.quant.fakequant import WeightScheme


def gptq_rows(w_orig: torch.Tensor, scheme: WeightScheme, hinv: torch.Tensor, dead: torch.Tensor,
               perm: torch.Tensor, inv_perm: torch.Tensor, gs: int, block_size: int,
               scale: torch.Tensor) -> torch.Tensor:
    """GPTQ's column loop over some rows of the weight, once per inverse factor in ``hinv``
    (``[C, in, in]``, permuted; candidates of ``damp="auto"`` share one loop): the integers as
    float64 in input order, ``[C, rows, in]``. ``scale`` (``[rows, n_groups]``) is fixed.

    On CUDA, inside :func:`row_graphs`, the loop replays as a CUDA graph (:class:`RowGraphs`)."""
    args = (w_orig, hinv, dead, perm, inv_perm, scale)
    statics = (scheme.qrange, gs, block_size)
    graphs = _ACTIVE
    if graphs is not None and graphs.wants(w_orig, hinv):
        return graphs.run(args, statics)
    return column_loop(*args, *statics)


#: columns whose rank-1 error updates run one at a time inside a block (see :func:`column_loop`)
SUB_BLOCK = 16


def column_loop(w_orig: torch.Tensor, hinv: torch.Tensor, dead: torch.Tensor, perm: torch.Tensor,
                 inv_perm: torch.Tensor, scale: torch.Tensor, qrange: tuple[int, int], gs: int,
                 block_size: int) -> torch.Tensor:
    """:func:`gptq_rows`'s arithmetic, with no host synchronisation and no data-dependent shape
    (masks by ``masked_fill``, group scales by ``expand``), so that a CUDA graph can capture it.

    Each column's error moves onto the columns after it. Within a block of ``block_size``
    columns that is done column by column only across a sub-block of :data:`SUB_BLOCK` columns;
    the sub-block's errors then reach the rest of the block in one product, and the block's the
    rest of the weight in another (GPTQ's lazy batch updates, nested once more). The arithmetic is
    the same sums in another order: on the CPU the one-column-at-a-time updates across a whole
    128-column block were 70% of GPTQ's solve time (a temporary of rows x remaining columns per
    column), and the nested form computes the same integers (tests/optimize/quant/test_gptq.py)."""
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
        for j1 in range(0, i2 - i1, SUB_BLOCK):
            j2 = min(j1 + SUB_BLOCK, i2 - i1)
            for i in range(j1, j2):
                col = w1[:, :, i]
                s = col_scale[:, i1 + i]
                qi = torch.clamp(torch.round(col / s), qmin, qmax)
                q[:, :, i1 + i] = qi
                e = (col - qi * s) / hinv1[:, i, i].unsqueeze(1)
                w1[:, :, i:j2] -= e.unsqueeze(2) * hinv1[:, i, i:j2].unsqueeze(1)
                err1[:, :, i] = e
            if j2 < i2 - i1:
                for c in range(n_c):
                    w1[c, :, j2:] -= err1[c, :, j1:j2] @ hinv1[c, j1:j2, j2:]
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
            eager = column_loop(*args, *statics)
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
            out = column_loop(*static_in, *statics)
        torch.cuda.current_stream(args[0].device).wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = column_loop(*static_in, *statics)
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


#: the graphs of the :func:`row_graphs` block in progress (None: the column loop runs eagerly)
_ACTIVE: RowGraphs | None = None


@contextlib.contextmanager
def row_graphs() -> Iterator[RowGraphs]:
    """CUDA graphs for every column loop run inside the block (one model's GPTQ), freed at its end."""
    global _ACTIVE
    graphs = _ACTIVE = RowGraphs()
    try:
        yield graphs
    finally:
        _ACTIVE = None
        graphs.graphs.clear()
