"""Work ExecuTorch's lowering does that changes nothing in the program, left out.

Two costs, both measured on SmolLM2-135M (8da4w, 512-token cache, 2 cores), both leaving the
program byte for byte what ExecuTorch alone writes (``tests/export/executorch/test_lowering_cost.py``
lowers several families both ways and compares the bytes):

- **XNNPACK passes that cannot apply** (:func:`applicable_passes_only`). ExecuTorch (1.5.1) runs
  the same 17 passes on every delegate, and every pass ends by re-tracing its graph with fake
  tensors and symbolic shapes, whether it changed a node or not. With one delegate per third of a
  layer (``split_layers``) SmolLM2 has 93 delegates, and 8 of the passes act on operators no
  decoder holds (batch norm, convolution, PReLU, padding, max-pooling, bilinear upsampling, and
  XNNPACK's own SDPA, which our attention does not use: it goes through ``llama::custom_sdpa``).
  A pass is dropped from a delegate's list when the delegate's graph lacks every operator the pass
  acts on; for a pass that rewrites a pattern, when the graph lacks one of the pattern's operators
  (a necessary condition for a match). What a pass would change, it still changes. Lowering:
  142 s -> 114 s. Six more passes act on operators (or metadata) a decoder's delegate seldom
  holds: activation fusion (ReLU/hardtanh), [add]mm to linear, dtype copies, cats of more than
  five inputs, dim-order ops and external-weight tags.
- **Provenance copies** (:func:`without_provenance`). Every re-trace records, on each new node,
  the node it came from with a deep copy of that node's own history (``torch.fx.traceback.NodeSource``),
  so the copies grow with every pass: about 10 s of the lowering. Of that history ExecuTorch reads
  only the oldest ancestor (its debug handles), so while lowering a new node records its direct
  source and that ancestor.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterator

import torch

#: stands, among a graph's operator names, for "some node carries ``meta["custom"]``"
CUSTOM_META = "meta:custom"

#: pass class name -> the operators it acts on (``__name__`` of their edge op); absent: always run
_OPERATORS: dict[str, frozenset[str]] = {
    "Conv1dUnsqueezePass": frozenset({"aten.convolution.default"}),
    "FuseBatchNormPass": frozenset({"aten._native_batch_norm_legit_no_training.default",
                                    "aten.native_batch_norm.default"}),
    "DecomposeBatchNorm": frozenset({"aten._native_batch_norm_legit_no_training.default",
                                     "aten.native_batch_norm.default"}),
    "PReLUReshapePass": frozenset({"aten._prelu_kernel.default"}),
    "InsertPadQDQPass": frozenset({"aten.constant_pad_nd.default"}),
    "RemoveGetItemPass": frozenset({"aten.max_pool2d_with_indices.default", "aten.max.dim"}),
    # fuses a ReLU/hardtanh into the operator before it
    "FuseActivationPass": frozenset({"aten.relu.default", "aten.hardtanh.default"}),
    # turns a Linear's [add]mm back into linear (a decoder's Linears reach XNNPACK as linear already)
    "ConvertToLinearPass": frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}),
    "RemoveRedundantCopyPass": frozenset({"aten._to_copy.default"}),
    # splits a cat of more than five inputs
    "DecomposeConcatenate": frozenset({"aten.cat.default"}),
    # the dim-order ops back to memory-format ops (a program lowered with _skip_dim_order has none)
    "DimOrderOpsRevertPass": frozenset({"dim_order_ops._to_dim_order_copy.default",
                                        "dim_order_ops._empty_dim_order.default",
                                        "dim_order_ops._clone_dim_order.default"}),
    # copies node.meta["custom"] (external-weight tags) onto the quantize/dequantize nodes after it
    "PropagateCustomMetaPass": frozenset({CUSTOM_META}),
}


@contextlib.contextmanager
def _replaced(owner, name: str, value) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block and what it was before on any exit."""
    stock = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, stock)


def _op_names(graph: torch.fx.Graph) -> set[str]:
    return {getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"}


def _features(graph: torch.fx.Graph) -> set[str]:
    """The graph's operator names, and :data:`CUSTOM_META` where a node carries custom metadata."""
    present = _op_names(graph)
    if any("custom" in n.meta for n in graph.nodes):
        present.add(CUSTOM_META)
    return present


@functools.cache
def _pattern_ops(pass_name: str) -> tuple[frozenset[str], ...] | None:
    """The operators of each pattern graph the pass's subgraph matcher looks for (read once, not per
    delegate), or None for a pass that matches no patterns."""
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    graphs = {"ConvertToUpsampleBilinear2d": bilinear_2d.get_graphs, "ConvertToSDPAPass": sdpa.get_graphs}.get(pass_name)
    return None if graphs is None else tuple(frozenset(_op_names(g.graph)) for g in graphs())


def may_apply(pass_name: str, present: set[str]) -> bool:
    """False only when the pass can change nothing in a graph whose operators are ``present``."""
    if pass_name in _OPERATORS:
        return bool(_OPERATORS[pass_name] & present)
    patterns = _pattern_ops(pass_name)
    if patterns is None:
        return True
    return any(ops <= present for ops in patterns)


@contextlib.contextmanager
def applicable_passes_only(skipped: dict[str, int] | None = None) -> Iterator[None]:
    """While lowering, each XNNPACK delegate runs only the passes that may apply to it.

    ``skipped`` (if given) counts, per pass, the delegates that did not run it."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    stock = XNNPACKPassManager.__init__

    def init(self, exported_program, passes=None) -> None:
        stock(self, exported_program, passes)
        if passes:  # a caller's own list (the dynamically quantized linear partitioner) runs as asked
            return
        present = _features(exported_program.graph)
        kept = [p for p in self.passes if may_apply(p.__name__, present)]
        if skipped is not None:
            for p in self.passes:
                if p not in kept:
                    skipped[p.__name__] = skipped.get(p.__name__, 0) + 1
        self.passes = kept

    with _replaced(XNNPACKPassManager, "__init__", init):
        yield


@functools.cache
def _prioritized_ops() -> frozenset:
    """The operators ``torch.fx.passes.tools_common.legalize_graph`` puts first when they become ready."""
    import operator

    aten = torch.ops.aten
    return frozenset((operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod,
                      operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne,
                      aten.sym_constrain_range.default, aten.sym_constrain_range_for_size.default,
                      aten._assert_async.msg, aten.scalar_tensor.default, aten._assert_scalar.default))


def legalize_in_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``legalize_graph``'s topological order (the same queue, the same tie-breaking), reached by
    moving the graph's own nodes instead of copying every node into a new graph."""
    import collections

    prioritized = _prioritized_ops()
    nodes = list(gm.graph.nodes)
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(n for n in nodes if indeg[n] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in prioritized:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        raise RuntimeError(f"Input graph has cycles, unable to add {[n for n in indeg if indeg[n] != 0]}")
    if order != nodes:
        root = gm.graph._root
        for node in order:  # each to the end, in order
            root.prepend(node)
    gm.recompile()
    return gm


@contextlib.contextmanager
def in_place_legalize() -> Iterator[None]:
    """While lowering, each new delegate's call is put in topological order by moving nodes.

    ExecuTorch cuts each delegate out of the whole graph and then calls ``legalize_graph`` on it,
    which copies every node of the graph into a new one: once per delegate (93 for SmolLM2), about
    10 s of the lowering. :func:`legalize_in_place` reaches the same order without the copies."""
    from executorch.exir import lowered_backend_module

    with _replaced(lowered_backend_module, "legalize_graph", legalize_in_place):
        yield


def _self_decomposing() -> frozenset:
    """Table entries whose decomposition traces back to the operator itself (``sym_size.int`` is
    CompositeImplicitAutograd: its kernel asks the tensor for its size, which records the same op)."""
    return frozenset({torch.ops.aten.sym_size.int})


@contextlib.contextmanager
def no_op_decompositions_skipped(skipped: list[int] | None = None) -> Iterator[None]:
    """While lowering, a decomposition of a program that earlier decompositions already made
    functional returns that program when the table holds none of its operators.

    ExecuTorch decomposes a program three times before partitioning (functionalize; the table
    less what the partitioner keeps; the whole table once the kept operators are set aside), and
    every pass re-traces the whole graph with fake tensors. On a decoder the third finds nothing
    left to decompose: about 14 s of SmolLM2's lowering. The first call (which functionalizes)
    always runs, and so does any call that meets an operator of its table. ``skipped`` (if given)
    gets one entry (the graph's node count) per skipped call."""
    from torch.export import ExportedProgram

    stock = ExportedProgram.run_decompositions
    functional: weakref.WeakSet = weakref.WeakSet()  # programs a decomposition returned
    ignore = _self_decomposing()

    def run_decompositions(self, decomp_table=None, *args, **kwargs):
        if decomp_table and self in functional:
            targets = {n.target for n in self.graph.nodes if n.op == "call_function"}
            if not (targets & set(decomp_table)) - ignore:
                if skipped is not None:
                    skipped.append(len(self.graph.nodes))
                return self
        out = stock(self, decomp_table, *args, **kwargs)
        functional.add(out)
        return out

    with _replaced(ExportedProgram, "run_decompositions", run_decompositions):
        yield


@contextlib.contextmanager
def without_provenance() -> Iterator[None]:
    """While lowering, a re-traced node records the node it came from and that node's oldest
    ancestor, not the whole history between them.

    The oldest ancestor is what ExecuTorch reads (its debug handles group the nodes that share one,
    ``executorch.exir.debug_handle_utils.get_greatest_ancestor_node_identifier``, following the
    last source of every level), so the program and its debug handles stay the same."""
    from torch.fx import traceback as fx_traceback

    stock = fx_traceback.NodeSource.__init__

    def init(self, node, pass_name: str = "", action=None) -> None:
        history = node.meta.get("from_node") if node is not None else None
        if not history:
            return stock(self, node, pass_name, action)
        oldest = history[-1]
        while oldest.from_node:
            oldest = oldest.from_node[-1]
        node.meta["from_node"] = [oldest]
        try:
            stock(self, node, pass_name, action)
        finally:
            node.meta["from_node"] = history

    with _replaced(fx_traceback.NodeSource, "__init__", init):
        yield
