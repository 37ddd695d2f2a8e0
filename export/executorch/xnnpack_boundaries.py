"""Where a decoder layer's XNNPACK delegate ends: at the residual adds.

Lowered whole, each decoder layer is one XNNPACK delegate of about 40 ops (30 layers: 33 calls a
step). Between two of them the calling thread runs alone: the KV-cache updates, then the next
delegate's start (XNNPACK reshapes the whole graph on every call). That stretch outlasts the short
spin of the threadpool's worker (libtorch's pthreadpool, which the Python bindings resolve, spins
1,000 ``pause`` instructions), so the worker goes to sleep once a layer and every wake-up waits
for the scheduler: on a 2-core host ``perf stat`` counted 16,750 context switches in 1,000 decode
steps of SmolLM2 8da4w where optimum-executorch's program, with small delegates, had 4,150.

Keeping the residual adds (``hidden + sublayer(hidden)``, both operands ``[..., T, hidden]``) out of
XNNPACK splits each layer into three delegates (attention output, MLP, next norm + q/k/v), each
quick to start. Measured on SmolLM2-135M 8da4w, 2 threads, programs timed round-robin in one
process: a decode step 5.9% shorter (3,826 context switches in 1,000 steps), prefill-128 7% longer
(the adds run in the portable kernel). An fp32 add is the same sum in either place, so the logits
do not change.
"""

from __future__ import annotations

import torch

from export.group_offset import GroupOffsetLinear


def _shape(arg) -> tuple | None:
    val = getattr(arg, "meta", {}).get("val") if isinstance(arg, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _inside_offset_linear(node: torch.fx.Node) -> bool:
    """Whether export traced ``node`` inside a ``GroupOffsetLinear.forward`` (its module stack,
    which the edge dialect keeps, ends with one)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return False
    _, owner = list(stack.values())[-1]
    name = owner if isinstance(owner, str) else f"{owner.__module__}.{owner.__qualname__}"
    return name == f"{GroupOffsetLinear.__module__}.{GroupOffsetLinear.__qualname__}"


def is_residual_add(node: torch.fx.Node, hidden: int) -> bool:
    """An ``add.Tensor`` of two same-shaped ``[..., T, hidden]`` tensors: the residual stream plus a
    sublayer's output (OPT adds its MLP's as ``[T, hidden]``; GPT-2 and OPT add their position
    embeddings the same way). RoPE's adds (per head), norm epsilons (scalars) and biases
    (``[hidden]``) are not, nor is the add inside a Linear's own forward that has the same shape:
    a kept source grid's offset (:class:`~export.group_offset.GroupOffsetLinear`, whose output is
    ``[..., T, hidden]`` for ``o_proj`` and ``down_proj``) belongs in the delegate with its GEMMs."""
    if len(node.args) < 2 or _inside_offset_linear(node):
        return False
    shapes = [_shape(a) for a in node.args[:2]]
    return all(s is not None and len(s) >= 2 and s[-1] == hidden for s in shapes) and shapes[0] == shapes[1]


def residual_boundary_config(add_config: type, hidden: int) -> type:
    """ExecuTorch's XNNPACK ``add`` partitioner config, refusing residual adds of width ``hidden``."""

    class ResidualBoundaryAddConfig(add_config):
        def check_constraints(self, node: torch.fx.Node, ep) -> bool:
            return not is_residual_add(node, hidden) and super().check_constraints(node, ep)

    return ResidualBoundaryAddConfig


def count_residual_adds(graph_module: torch.fx.GraphModule, hidden: int) -> int:
    """Residual adds left outside XNNPACK in a lowered graph (for the export report)."""
    return sum(1 for n in graph_module.graph.nodes
               if n.op == "call_function" and "add" in str(n.target) and is_residual_add(n, hidden))
