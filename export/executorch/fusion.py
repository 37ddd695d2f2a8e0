"""Fewer, larger GEMMs: the projections that read the same input become one Linear.

A decode step of a small LM is a few hundred GEMVs. Each XNNPACK fully-connected op costs a
thread-pool dispatch and its own dynamic quantization of the input on top of the bytes it
reads, so q/k/v (3 GEMMs) and gate/up (2) as one GEMM each save 3 of 7 ops a layer.

* :func:`fuse_projections` concatenates the weights of sibling ``q_proj``/``k_proj``/``v_proj``
  and ``gate_proj``/``up_proj`` along the output dim (plain tensors, or torchao's
  ``IntxUnpackedToInt8Tensor`` component by component, so quantized weights stay bit-identical)
  and gives each member a :class:`ProjectionSlice` that runs the shared Linear and takes its
  columns. The model code is untouched: members called on the same input trace to identical
  nodes, and a member called on another input still computes its own columns correctly.
* :func:`merge_duplicate_linears` then merges the members' identical linears in the exported
  graph (each traced the shared Linear with its own dynamic quantization of the same input),
  which leaves one GEMM and static-dim slices that XNNPACK runs (:mod:`export.executorch.xnnpack_slices`).

Members are fused only when their weights have the same scheme; a mixed group stays as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from export.group_offset import GroupOffsetLinear

#: attribute under which a member holds the shared Linear (module paths end in it; the scheme
#: check strips it to name the member)
FUSED_ATTR = "fused_projection"
#: sibling Linear names that read the same input in transformers' decoder layers
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class ProjectionSlice(nn.Module):
    """One member of a fused projection: the shared Linear's output columns ``[start, end)``."""

    def __init__(self, fused: nn.Module, start: int, end: int):
        super().__init__()
        setattr(self, FUSED_ATTR, fused)
        self.start, self.end = int(start), int(end)
        self.in_features, self.out_features = fused.in_features, self.end - self.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, FUSED_ATTR)(x)[..., self.start:self.end]


def _scheme_key(w: torch.Tensor) -> tuple | None:
    """What must agree for two weights to be concatenated exactly; None: not concatenable."""
    if type(w) in (torch.Tensor, nn.Parameter):
        return ("dense", w.dtype)
    if type(w).__name__ == "IntxUnpackedToInt8Tensor":
        block = tuple(w.block_size)
        if len(block) != 2 or block[0] != 1:
            return None
        return ("intx", w.target_dtype, block[1], w.dtype, w.activation_quantization, w.scale.dtype,
                w.zero_point.dtype)
    return None


def _concat_weights(weights: list[torch.Tensor]) -> torch.Tensor:
    first = weights[0]
    if type(first) in (torch.Tensor, nn.Parameter):
        return torch.cat([w.detach() for w in weights], dim=0)
    cls = type(first)
    return cls(
        torch.cat([w.qdata for w in weights], dim=0),
        torch.cat([w.scale for w in weights], dim=0),
        torch.cat([w.zero_point for w in weights], dim=0),
        first.target_dtype,
        list(first.block_size),
        first.dtype,
        first.activation_quantization,
    )


def _fused_linear(members: list[nn.Linear]) -> nn.Linear | None:
    """One Linear whose output columns are the members' in order, or None where they cannot be
    concatenated exactly (other input widths, other schemes)."""
    if not all(type(m) is nn.Linear for m in members) or len({m.in_features for m in members}) != 1:
        return None
    keys = {_scheme_key(m.weight) for m in members}
    if len(keys) != 1 or None in keys:
        return None
    weight = _concat_weights([m.weight for m in members])
    has_bias = [m.bias is not None for m in members]
    fused = nn.Linear(members[0].in_features, sum(m.out_features for m in members), bias=any(has_bias),
                      device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if any(has_bias):
        dtype = next(m.bias.dtype for m in members if m.bias is not None)
        fused.bias = nn.Parameter(torch.cat([
            m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=dtype) for m in members
        ]), requires_grad=False)
    return fused


def _row_slice(w: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of a plain or torchao ``IntxUnpackedToInt8Tensor`` weight."""
    if type(w) in (torch.Tensor, nn.Parameter):
        return w.detach()[start:end]
    return type(w)(w.qdata[start:end], w.scale[start:end], w.zero_point[start:end], w.target_dtype,
                   list(w.block_size), w.dtype, w.activation_quantization)


def _fused_offset(members: list[GroupOffsetLinear]) -> GroupOffsetLinear | None:
    """Members that each carry a per-group offset path (a source grid kept exactly): their int4
    rows stacked, followed by one copy of the group-sum rows, and their offset Linears stacked."""
    first = members[0]
    if len({(m.group_size, m.in_features) for m in members}) != 1:
        return None
    if len({_scheme_key(m.linear.weight) for m in members}) != 1 or _scheme_key(first.linear.weight) is None:
        return None
    offset = _fused_linear([m.offset for m in members])
    if offset is None:
        return None
    weight = _concat_weights([_row_slice(m.linear.weight, 0, m.out_features) for m in members]
                             + [_row_slice(first.linear.weight, first.out_features, first.out_features + first.groups)])
    fused = GroupOffsetLinear(first.in_features, sum(m.out_features for m in members), first.group_size,
                              offset.bias is not None, device="meta")
    fused.linear.weight = nn.Parameter(weight, requires_grad=False)
    fused.offset = offset
    return fused


def _fuse(parent: nn.Module, names: tuple[str, ...]) -> bool:
    members = [getattr(parent, n, None) for n in names]
    if all(type(m) is GroupOffsetLinear for m in members):
        fused = _fused_offset(members)
    else:
        fused = _fused_linear(members)
    if fused is None:
        return False
    start = 0
    for name, m in zip(names, members):
        setattr(parent, name, ProjectionSlice(fused, start, start + m.out_features))
        start += m.out_features
    return True


def fuse_projections(model: nn.Module) -> dict[str, Any]:
    """Fuse every q/k/v and gate/up group of ``model`` in place (give it a copy). Returns counts
    for the report: groups fused, and groups left apart because their schemes differ."""
    fused = {"+".join(g): 0 for g in GROUPS}
    kept = 0
    for parent in list(model.modules()):
        for group in GROUPS:
            if all(isinstance(getattr(parent, n, None), nn.Module) for n in group):
                if _fuse(parent, group):
                    fused["+".join(group)] += 1
                else:
                    kept += 1
    return {"fused": fused, "left_apart": kept}


def member_path(path: str) -> str:
    """The member's own module path for a node traced inside its shared Linear (``q_proj.fused_projection``
    -> ``q_proj``; inside a shared offset path, ``q_proj.fused_projection.linear`` -> ``q_proj.linear``)."""
    return path.replace("." + FUSED_ATTR, "", 1)


def _pure(target: Any) -> bool:
    import operator

    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return target.namespace in ("aten", "torchao", "quantized_decomposed")


def _same(a: Any, b: Any, memo: dict) -> bool:
    """Whether two graph values are computed the same way: the same node, equal constants, or the
    same pure op applied to values that are the same."""
    if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
        if a is b:
            return True
        key = (a, b)
        if key not in memo:
            memo[key] = (a.op == b.op == "call_function" and a.target is b.target and _pure(a.target)
                         and _same(a.args, b.args, memo) and _same(a.kwargs, b.kwargs, memo))
        return memo[key]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y, memo) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], memo) for k in a)
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return False
    return type(a) is type(b) and a == b


def merge_duplicate_linears(ep: torch.export.ExportedProgram) -> int:
    """Merge ``aten.linear`` nodes that compute the same thing: the same weight and bias, and inputs
    computed the same way from the same value (a fused group's members each trace the shared
    Linear with its own dynamic quantization of the same activation). The duplicates' own input
    chains are then dead and removed, so the survivor keeps a single-user chain, the form
    XNNPACK's dynamically quantized fully-connected pattern matches. Nothing else is merged.
    Returns how many linears were removed."""
    graph = ep.graph_module.graph
    memo: dict = {}
    kept: list[torch.fx.Node] = []
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        # weight and bias first: they differ for all but a fused group's members, and comparing the
        # inputs of unrelated linears would recurse down the whole residual stream
        twin = next((k for k in kept if _same(k.args[1:], node.args[1:], memo) and _same(k.kwargs, node.kwargs, memo)
                     and _same(k.args[0], node.args[0], memo)), None)
        if twin is None:
            kept.append(node)
            continue
        node.replace_all_uses_with(twin)
        graph.erase_node(node)
        merged += 1
    if merged:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return merged
