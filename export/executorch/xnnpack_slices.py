"""Slices of a dynamic-length tensor along a static dim, inside XNNPACK.

ExecuTorch's XNNPACK partitioner (executorch 1.5.1) refuses every ``slice_copy`` whose input or
output has a symbolic dim, because its serializer writes the traced sizes as constants. Under a
dynamic sequence length that leaves the split of a fused projection (``qkv[..., :q]``, Phi-3's
``gate_up.chunk(2)``, GPT-2's ``c_attn`` split) in the portable kernels, between two delegate
calls. XNNPACK itself takes a size of 0 as "the whole input dim" (its static-slice reshape
re-reads the input shape on every call), so a slice along a static dim whose other dims pass
through unchanged is exact for every length: :class:`DynamicSliceConfig` admits those and
:func:`dynamic_slices` serializes their symbolic sizes as 0. ``tests/export/executorch/test_xnnpack_slices.py``
checks the lowered program against eager at several lengths, so an XNNPACK that changed that
convention would be caught there, not in a user's logits.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_SLICE = "aten.slice_copy.Tensor"


def _slice_dims(node: torch.fx.Node) -> tuple[list, list, int] | None:
    """(input shape, output shape, sliced dim) of a slice node that only narrows a static dim, or None."""
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or "val" not in src.meta or "val" not in node.meta:
        return None
    shape_in, shape_out = list(src.meta["val"].shape), list(node.meta["val"].shape)
    if len(shape_in) != len(shape_out) or not shape_in:
        return None
    dim = int(node.args[1]) % len(shape_in) if len(node.args) > 1 else 0
    if not isinstance(shape_in[dim], int) or not isinstance(shape_out[dim], int) or shape_out[dim] == 0:
        return None
    for i, (a, b) in enumerate(zip(shape_in, shape_out)):
        if i == dim:
            continue
        if isinstance(a, int) != isinstance(b, int) or (isinstance(a, int) and a != b) or a == 0:
            return None
        if not isinstance(a, int) and str(a) != str(b):  # the same symbol passes through
            return None
    return shape_in, shape_out, dim


def _has_symbolic(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape)


def _start(node: torch.fx.Node, size: int) -> int | None:
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    if not isinstance(start, int):
        return None
    return start + size if start < 0 else start


def partitioner_configs(residual_boundaries_at: int | None = None) -> list:
    """ExecuTorch's XNNPACK partitioner configs with slicing admitted under dynamic shapes, and,
    given the hidden size, residual adds kept out (:mod:`export.executorch.xnnpack_boundaries`)."""
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.generic_node_configs import AddConfig, SliceCopyConfig

    from export.executorch.xnnpack_boundaries import residual_boundary_config

    class DynamicSliceConfig(SliceCopyConfig):
        """``slice_copy`` along a static dim, stride 1, every symbolic dim passed through."""

        def check_constraints(self, node: torch.fx.Node, ep) -> bool:
            if not _has_symbolic(node):
                return super().check_constraints(node, ep)
            if not self.check_common_constraints(node, ep):
                return False
            if len(node.args) > 4 and node.args[4] != 1:
                return False
            dims = _slice_dims(node)
            if dims is None or _start(node, dims[0][dims[2]]) is None:
                return False
            src = node.args[0]
            # quantized slices must keep their parameters; only the plain fp32 case is admitted
            return "dequantize" not in str(getattr(src, "target", ""))

    swap = {SliceCopyConfig: DynamicSliceConfig}
    if residual_boundaries_at is not None:
        swap[AddConfig] = residual_boundary_config(AddConfig, residual_boundaries_at)
    return [swap.get(c, c) for c in ALL_PARTITIONER_CONFIGS]


@contextlib.contextmanager
def dynamic_slices() -> Iterator[None]:
    """While lowering, serialize a slice with symbolic dims with size 0 (XNNPACK: the whole dim)
    there; slices with static shapes go through ExecuTorch's own visitor unchanged."""
    from executorch.backends.xnnpack.operators import node_visitor
    from executorch.backends.xnnpack.serialization.xnnpack_graph_schema import XNNStaticSlice, XNode

    import executorch.backends.xnnpack.operators  # noqa: F401  (registers the stock visitors)

    stock = node_visitor._node_visitor_dict[_SLICE]

    class DynamicSliceVisitor(stock):
        def define_node(self, node, xnn_graph, vals_to_ids, debug_handle) -> None:
            if not _has_symbolic(node):
                return super().define_node(node, xnn_graph, vals_to_ids, debug_handle)
            dims = _slice_dims(node)
            if dims is None or "XNN_NHWC_NODE" in node.meta:
                raise RuntimeError(f"slice {node.name} with symbolic dims reached XNNPACK in a form it cannot serialize")
            shape_in, shape_out, dim = dims
            self.define_nodes_tensor_inputs_outputs(node, xnn_graph, vals_to_ids)
            offsets = [0] * len(shape_in)
            offsets[dim] = _start(node, shape_in[dim])
            sizes = [d if isinstance(d, int) else 0 for d in shape_out]
            xnn_graph.xnodes.append(XNode(
                xnode_union=XNNStaticSlice(num_dims=len(shape_in), offsets=offsets, sizes=sizes,
                                           input_id=vals_to_ids[node.args[0]], output_id=vals_to_ids[node], flags=0),
                debug_handle=debug_handle,
            ))

    node_visitor._node_visitor_dict[_SLICE] = DynamicSliceVisitor
    try:
        yield
    finally:
        node_visitor._node_visitor_dict[_SLICE] = stock
