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
  142 s -> 114 s.
- **Provenance copies** (:func:`without_provenance`). Every re-trace records, on each new node,
  the node it came from with a deep copy of that node's own history (``torch.fx.traceback.NodeSource``),
  so the copies grow with every pass: about 10 s of the lowering. Of that history ExecuTorch reads
  only the oldest ancestor (its debug handles), so while lowering a new node records its direct
  source and that ancestor.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

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
}


def _op_names(graph: torch.fx.Graph) -> set[str]:
    return {getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"}


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
        present = _op_names(exported_program.graph)
        kept = [p for p in self.passes if may_apply(p.__name__, present)]
        if skipped is not None:
            for p in self.passes:
                if p not in kept:
                    skipped[p.__name__] = skipped.get(p.__name__, 0) + 1
        self.passes = kept

    XNNPACKPassManager.__init__ = init
    try:
        yield
    finally:
        XNNPACKPassManager.__init__ = stock


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

    fx_traceback.NodeSource.__init__ = init
    try:
        yield
    finally:
        fx_traceback.NodeSource.__init__ = stock
