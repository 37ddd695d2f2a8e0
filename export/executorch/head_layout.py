"""Keep attention heads as ``[B, T, H, D]`` from the projections to ExecuTorch's cache ops.

transformers' attention turns each projection into ``[B, H, T, D]`` (a transpose), applies RoPE
there, and hands the result to the attention function; ``llama::update_cache`` and
``llama::custom_sdpa`` take ``[B, T, H, D]``, so :mod:`export.executorch.llm` transposes q, k and
v back. Six transposes a layer cancel in pairs, but XNNPACK runs each as its own operator: on
SmolLM2-135M they were 180 of the 1,480 XNNPACK operators of a decode step, each a thread-pool
dispatch over a few hundred floats.

:func:`cancel_head_transposes` removes such a pair when everything between the two transposes is
layout-agnostic along the swapped dims: RoPE's elementwise products and sums, its negation, and
slices and concatenations along the head dim (``rotate_half``, partial rotary). A broadcast operand
of those ops (RoPE's ``cos``/``sin`` as ``[B, 1, T, D]``) is given as ``[B, T, 1, D]`` instead, one
view per source shared by every layer. The values are the same floats computed by the same
operations, element for element: the rewrite moves data layout, not arithmetic. A region with any
other consumer (a matmul over ``[B, H, T, D]``, as the soft-capped attention uses) is left alone.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

#: ops that compute each element from the same-index elements of their inputs (plus broadcasts)
_ELEMENTWISE = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.neg.default,
                aten.rsqrt.default, aten.to.dtype}
#: ops that act along the last (head) dim only: RoPE's halves, and a per-head RMSNorm (Qwen3,
#: Gemma-3) whose mean is a Linear over the head dim (export.executorch.delegable)
_LAST_DIM = {aten.slice.Tensor, aten.cat.default, aten.linear.default}


def _swaps_1_2(node: torch.fx.Node) -> bool:
    """Whether ``node`` swaps dims 1 and 2 of a rank-4 tensor (``transpose(1, 2)`` or a permute)."""
    if node.op != "call_function":
        return False
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return False
    if node.target is aten.transpose.int:
        return sorted(d % 4 for d in node.args[1:3]) == [1, 2]
    if node.target is aten.permute.default:
        return [d % 4 for d in node.args[1]] == [0, 2, 1, 3]
    return False


def _rank(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _is_head_broadcast(node: torch.fx.Node) -> bool:
    """A rank-4 operand with a single head (``[B, 1, T, D]``): swapping its dims 1 and 2 is a view."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 4 and isinstance(val.shape[1], int) and val.shape[1] == 1


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs that carry the region's layout (a Linear's weight and bias do not)."""
    if node.target is aten.cat.default:
        return [a for a in node.args[0] if isinstance(a, torch.fx.Node)]
    if node.target is aten.linear.default:
        return [node.args[0]]
    return [a for a in node.args if isinstance(a, torch.fx.Node)]


def _checks_dtype_only(node: torch.fx.Node) -> bool:
    """A metadata assertion torch.export leaves beside a cast that does not pin shape or strides."""
    return (node.target is aten._assert_tensor_metadata.default and node.kwargs.get("size") is None
            and node.kwargs.get("stride") is None and len(node.args) <= 1)


def _region(start: torch.fx.Node) -> tuple[set[torch.fx.Node], set[torch.fx.Node]] | None:
    """The nodes between ``start`` (a dim-1/2 swap) and the swaps that undo it, and those closing
    swaps; None when any value in between is used another way."""
    inner: set[torch.fx.Node] = set()
    ends: set[torch.fx.Node] = set()
    todo = list(start.users)
    while todo:
        node = todo.pop()
        if node in inner or node in ends:
            continue
        if _swaps_1_2(node):
            ends.add(node)
            continue
        if _checks_dtype_only(node):
            continue
        if node.op != "call_function" or node.target not in _ELEMENTWISE | _LAST_DIM or _rank(node) != 4:
            return None
        if node.target in (aten.slice.Tensor, aten.cat.default):
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            if not isinstance(dim, int) or dim % 4 != 3:
                return None
        inner.add(node)
        todo.extend(node.users)
    if not ends:
        return None
    inside = inner | {start}
    for node in inner:
        for arg in _tensor_inputs(node):
            if arg in inside:
                continue
            rank = _rank(arg)
            # a scalar or per-channel vector broadcasts against the last dim in either layout
            if node.target in _ELEMENTWISE and (rank is not None and rank <= 1 or _is_head_broadcast(arg)):
                continue
            return None
    if any(end.args[0] not in inside for end in ends):  # a closing swap must read this region's value
        return None
    return inner, ends


def _swapped_view(graph: torch.fx.Graph, operand: torch.fx.Node, memo: dict) -> tuple[torch.fx.Node, bool]:
    """``operand`` (``[B, 1, T, D]``) as ``[B, T, 1, D]``, and whether that took a transpose.

    When the operand is its rank-3 source with a head dim inserted (RoPE's ``cos.unsqueeze(1)``),
    the new view inserts it at dim 2 instead: no data moves, and every layer shares the one node."""
    val = operand.meta["val"]
    want = [val.shape[0], val.shape[2], val.shape[3]]
    src = operand.args[0] if operand.target in (aten.view.default, aten.unsqueeze.default) else None
    src_val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    if isinstance(src_val, torch.Tensor) and [str(d) for d in src_val.shape] == [str(d) for d in want]:
        key, anchor = ("view", src), src
        shape = [d if isinstance(d, int) else -1 for d in (want[0], want[1], 1, want[2])]
        # a view with one -1 lowers to XNNPACK's static reshape (export.executorch.delegable)
        target, args = (aten.view.default, (src, shape)) if shape.count(-1) <= 1 else (aten.unsqueeze.default, (src, 2))
    else:
        key, anchor, target, args = ("transpose", operand), operand, aten.transpose.int, (operand, 1, 2)
    if key not in memo:
        with graph.inserting_after(anchor):
            new = graph.call_function(target, args)
        new.meta["val"] = val.transpose(1, 2).contiguous()
        memo[key] = new
        return new, target is aten.transpose.int
    return memo[key], False


def cancel_head_transposes(ep: torch.export.ExportedProgram) -> int:
    """Remove each dim-1/2 swap of a rank-4 tensor together with the swaps that undo it, when only
    layout-agnostic ops lie between them (see the module docstring). Returns how many transposes
    fewer the graph has (a broadcast operand that is not a view of a rank-3 tensor costs one)."""
    graph = ep.graph_module.graph
    memo: dict = {}
    erased: set[torch.fx.Node] = set()
    removed = rewritten = 0
    for start in [n for n in graph.nodes if _swaps_1_2(n)]:
        if start in erased or not start.users:  # an earlier region's closing swap, or dead
            continue
        found = _region(start)
        if found is None:
            continue
        inner, ends = found
        for node in inner:
            if node.target in _ELEMENTWISE:
                args = []
                for a in node.args:
                    if isinstance(a, torch.fx.Node) and a is not start and a not in inner and _rank(a) == 4:
                        a, added = _swapped_view(graph, a, memo)
                        removed -= added
                    args.append(a)
                node.args = tuple(args)
            node.meta["val"] = node.meta["val"].transpose(1, 2).contiguous()
        for end in ends:
            end.replace_all_uses_with(end.args[0])
            graph.erase_node(end)
        start.replace_all_uses_with(start.args[0])
        graph.erase_node(start)
        erased.update(ends)
        removed += 1 + len(ends)
        rewritten += 1
    if rewritten:  # not ``removed``: a region whose operands took transposes may net zero
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return removed
