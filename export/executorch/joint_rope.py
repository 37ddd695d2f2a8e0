"""RoPE on q and k as one tensor: the heads of both, side by side, rotated by one chain of ops.

After :mod:`export.executorch.fusion` a layer's q and k are adjacent column ranges
of one Linear's output, and after :mod:`export.executorch.head_layout` both are ``[B, T, H, D]`` rotated by the
same ``cos``/``sin``. transformers still rotates them apart: two chains of seven ops (``x * cos``,
two half slices, a negation, a concatenation, ``* sin``, a sum), each op its own XNNPACK operator
and thread-pool dispatch. :func:`rope_q_and_k_together` slices q and k out of the Linear as one
``[B, T, Hq + Hk, D]`` tensor, rotates it once, and slices the rotated q and k apart: 18 operators
become 11. Every element goes through the same multiplications and sums as before, so the values
are bit-identical. Layers whose q or k take another path (a per-head norm between the slice and
RoPE, partial rotary, q and k from different Linears) are left as they are.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten
_END = 2**63 - 1  # how torch.export writes an open slice end


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _shape(node) -> list:
    return list(node.meta["val"].shape)


def _half_slice(node, x) -> tuple[int, int] | None:
    """(start, end) when ``node`` is ``x[..., start:end]`` of a rank-4 ``x``."""
    if not _is(node, aten.slice.Tensor) or node.args[0] is not x or len(node.args) < 4:
        return None
    dim, start, end = node.args[1], node.args[2], node.args[3]
    if dim % 4 != 3 or not isinstance(start, int) or not isinstance(end, int):
        return None
    return start, end


def _chain(add: torch.fx.Node) -> dict | None:
    """``x * cos + cat(-x[..., h:], x[..., :h]) * sin`` ending at ``add``, as its parts."""
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None
    for m1, m2 in (add.args, add.args[::-1]):
        if not (_is(m1, aten.mul.Tensor) and _is(m2, aten.mul.Tensor)):
            continue
        x, cos = m1.args
        cat, sin = m2.args
        if not _is(cat, aten.cat.default) or len(cat.args[0]) != 2 or (cat.args[1] if len(cat.args) > 1 else 0) % 4 != 3:
            continue
        neg, low = cat.args[0]
        if not _is(neg, aten.neg.default):
            continue
        lo, hi = _half_slice(low, x), _half_slice(neg.args[0], x)
        d = _shape(x)[-1] if isinstance(x, torch.fx.Node) and x.meta.get("val") is not None else None
        if lo is None or hi is None or d is None or lo != (0, hi[0]) or hi[1] < d or 2 * hi[0] != d:
            continue
        return {"x": x, "cos": cos, "sin": sin, "add_first": add.args[0] is m1, "out": add}
    return None


def _heads_of(x: torch.fx.Node) -> tuple | None:
    """(Linear output, first column, end column, view shape) when ``x`` is
    ``view(out[..., a:b], [B, -1, H, D])``."""
    if not _is(x, aten.view.default) or not _is(x.args[0], aten.slice.Tensor):
        return None
    sl, shape = x.args[0], list(x.args[1])
    src, dim, start, end = (list(sl.args) + [None, None, None])[:4]
    rank = len(_shape(src)) if isinstance(src, torch.fx.Node) and src.meta.get("val") is not None else None
    if rank is None or not isinstance(dim, int) or dim % rank != rank - 1 or len(shape) != 4:
        return None
    if not isinstance(start, int) or not isinstance(end, int) or not all(isinstance(s, int) for s in shape):
        return None
    return src, start, min(end, _shape(src)[-1]), shape


def _fake(target, *args):
    """Run ``target`` on the fake values of ``args`` (the new node's ``meta['val']``)."""
    vals = tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, args)
    mode = next(v.fake_mode for v in tree_leaves(vals) if hasattr(v, "fake_mode"))
    with mode:
        return target(*vals)


def _call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = _fake(target, *args)
    return node


def rope_q_and_k_together(ep: torch.export.ExportedProgram) -> int:
    """Rotate each layer's q and k as one tensor where they are adjacent columns of one Linear
    and share ``cos``/``sin`` (see the module docstring). Returns how many layers changed."""
    graph = ep.graph_module.graph
    groups: dict = {}
    for node in graph.nodes:
        chain = _chain(node)
        heads = _heads_of(chain["x"]) if chain else None
        if heads is None:
            continue
        src, start, end, shape = heads
        key = (src, chain["cos"], chain["sin"], shape[-1], chain["add_first"])
        groups.setdefault(key, []).append((start, end, shape, chain))
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = 0
    for (src, cos, sin, d, add_first), members in groups.items():
        if len(members) != 2:
            continue
        (q_start, q_end, q_shape, q), (k_start, k_end, k_shape, k) = sorted(members, key=lambda m: m[0])
        if q_end != k_start or q_shape[0] != k_shape[0] or q_shape[1] != -1 or k_shape[1] != -1:
            continue
        outs = [q["out"], k["out"]]
        users = [u for o in outs for u in o.users]
        if not users:
            continue
        first_user = min(users, key=order.__getitem__)
        if max(order[n] for n in (src, cos, sin) if isinstance(n, torch.fx.Node)) >= order[first_user]:
            continue
        hq, hk = q_shape[2], k_shape[2]
        with graph.inserting_before(first_user):
            sl = _call(graph, aten.slice.Tensor, src, len(_shape(src)) - 1, q_start, k_end)
            x = _call(graph, aten.view.default, sl, [q_shape[0], -1, hq + hk, d])
            m1 = _call(graph, aten.mul.Tensor, x, cos)
            low = _call(graph, aten.slice.Tensor, x, 3, 0, d // 2)
            high = _call(graph, aten.slice.Tensor, x, 3, d // 2, _END)
            neg = _call(graph, aten.neg.default, high)
            cat = _call(graph, aten.cat.default, [neg, low], -1)
            m2 = _call(graph, aten.mul.Tensor, cat, sin)
            out = _call(graph, aten.add.Tensor, *((m1, m2) if add_first else (m2, m1)))
            new_q = _call(graph, aten.slice.Tensor, out, 2, 0, hq)
            new_k = _call(graph, aten.slice.Tensor, out, 2, hq, hq + hk)
        outs[0].replace_all_uses_with(new_q)
        outs[1].replace_all_uses_with(new_k)
        changed += 1
    if changed:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return changed
