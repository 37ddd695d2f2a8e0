"""Per-token W8A8 without its per-token cost at decode: one graph, two branches.

The per-token activation quantization of :func:`export.onnxruntime.fused._per_token_nodes` is a chain of
~18 standard ops per Linear; at decode (one token per call) it costs more in op dispatch than
the int8 matmul itself. With one token, per-token and per-tensor quantization are the same
arithmetic, and ORT has that fused: ``DynamicQuantizeMatMul`` (uint8 asymmetric activation,
``scale = (max(x, 0) - min(x, 0)) / 255``, the same grid). So the graph becomes
``If(sequence_length == 1)``: the *decode* branch runs each int8 Linear as one
``DynamicQuantizeMatMul``, the *prefill* branch keeps the per-token chain. Both read the same
int8 weights (outer-scope initializers): no bytes are duplicated, and both give the logits of
the per-token arithmetic.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS = "com.microsoft"


@dataclass
class Chain:
    """One per-token Linear: activation in, logits out, int8 weight and column scales, and the
    names of the chain's nodes."""

    x: str
    y: str
    weight: str
    col_scale: str
    nodes: frozenset[str]
    #: uint8 weights (u8u8): their per-column zero point; None for int8 weights
    weight_zero_point: str | None = None


def _scoped(nodes: list[onnx.NodeProto], prefix: str) -> list[onnx.NodeProto]:
    """Copies of ``nodes`` whose produced values (and names) carry ``prefix``: a subgraph must
    not reuse a name of the outer graph."""
    produced = {o for n in nodes for o in n.output if o}
    out = []
    for n in nodes:
        c = copy.deepcopy(n)
        c.input[:] = [prefix + i if i in produced else i for i in c.input]
        c.output[:] = [prefix + o if o else o for o in c.output]
        c.name = prefix + c.name
        out.append(c)
    return out


def _branch(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], prefix: str, name: str) -> onnx.GraphProto:
    outs = [copy.deepcopy(o) for o in graph.output]
    for o in outs:
        o.name = prefix + o.name
    return helper.make_graph(_scoped(nodes, prefix), name, [], outs)


def add_decode_branch(model: onnx.ModelProto, chains: list[Chain], ids_input: str = "input_ids") -> int:
    """Wrap the graph in ``If(sequence_length == 1)`` with a DynamicQuantizeMatMul decode branch
    (in place); returns the number of Linears the decode branch fuses (0: nothing to do)."""
    if not chains:
        return 0
    g = model.graph
    nodes = list(g.node)
    starts = {}
    for c in chains:
        first = next(n.name for n in nodes if n.name in c.nodes)
        starts[first] = c
    members = set().union(*(c.nodes for c in chains))
    decode = []
    for n in nodes:
        if n.name in starts:
            c = starts[n.name]
            decode.append(helper.make_node("DynamicQuantizeMatMul", [c.x, c.weight, c.col_scale]
                                           + ([c.weight_zero_point] if c.weight_zero_point else []), [c.y],
                                           name=f"{c.y}/DynamicQuantizeMatMul", domain=MS))
        elif n.name not in members:
            decode.append(n)
    one = "/decode_branch/one"
    g.initializer.append(numpy_helper.from_array(np.array([1], np.int64), one))
    pre = [
        helper.make_node("Shape", [ids_input], ["/decode_branch/seq"], name="/decode_branch/Shape", start=1, end=2),
        helper.make_node("Equal", ["/decode_branch/seq", one], ["/decode_branch/eq"], name="/decode_branch/Equal"),
        helper.make_node("Squeeze", ["/decode_branch/eq"], ["/decode_branch/is_decode"], name="/decode_branch/Squeeze"),
        helper.make_node("If", ["/decode_branch/is_decode"], [o.name for o in g.output], name="/decode_branch/If",
                         then_branch=_branch(g, decode, "decode/", "decode"),
                         else_branch=_branch(g, nodes, "prefill/", "prefill")),
    ]
    del g.node[:]
    g.node.extend(pre)
    return len(chains)


def all_nodes(graph: onnx.GraphProto):
    """Every node of the graph and of its subgraphs (If branches)."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(a.g)
