"""Slices of a dynamic-length tensor along a static dim run inside XNNPACK and stay exact.

The exporter serializes their symbolic sizes as 0, which XNNPACK (executorch 1.5.1) reads as
"the whole input dim" on every call; these tests would catch an XNNPACK that stopped doing so.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(600)


class _Split(nn.Module):
    """A fused projection split three ways (q/k/v-like), a gated product, and a slice along the
    dynamic dim (the last position) that must stay outside XNNPACK."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 96)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        y = self.proj(x)
        a, b, c = y[..., :32], y[..., 32:64], y[..., 64:]
        h = self.out(torch.nn.functional.silu(a) * b + c)
        return h, h[:, -1:, :]


def _lower(model: nn.Module, *, dynamic_slices: bool):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from export.executorch import xnnpack_slices

    seq = torch.export.Dim("seq", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(1, 4, 32),), dynamic_shapes=({1: seq},), strict=True)
    if dynamic_slices:
        with xnnpack_slices.dynamic_slices():
            edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner(configs=xnnpack_slices.partitioner_configs())])
    else:
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    portable = [str(n.target) for n in edge.exported_program().graph.nodes
                if n.op == "call_function" and "executorch_call_delegate" not in str(n.target) and "getitem" not in str(n.target)]
    return edge.to_executorch().buffer, portable


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    torch.manual_seed(0)
    model = _Split().eval()
    out = {}
    for flag in (True, False):
        data, portable = _lower(model, dynamic_slices=flag)
        path = tmp_path_factory.mktemp("slices") / f"{flag}.pte"
        path.write_bytes(data)
        out[flag] = (path, portable)
    return model, out


def test_static_dim_slices_are_delegated(lowered):
    _, out = lowered
    with_, stock = out[True][1], out[False][1]
    # ExecuTorch's own partitioner leaves the three splits (and the last-position slice) portable
    assert sum("slice_copy" in t for t in stock) == 4, stock
    # ours delegates the three static-dim splits; the slice along the dynamic dim stays portable
    assert sum("slice_copy" in t for t in with_) == 1, with_


@pytest.mark.parametrize("length", [1, 2, 7, 33, 64, 3, 1])
def test_exact_at_every_length(lowered, length):
    """Lengths change from call to call on one loaded program (XNNPACK reshapes each time)."""
    from executorch.runtime import Runtime

    model, out = lowered
    method = Runtime.get().load_program(out[True][0]).load_method("forward")
    x = torch.randn(1, length, 32, generator=torch.Generator().manual_seed(length))
    got = method.execute([x])
    with torch.no_grad():
        want = model(x)
    assert got[0].shape == want[0].shape == (1, length, 8)
    assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5), (got[0] - want[0]).abs().max()
    assert torch.allclose(got[1], want[1], atol=1e-5, rtol=1e-5)


def test_stock_visitor_is_restored():
    from executorch.backends.xnnpack.operators import node_visitor

    from export.executorch.xnnpack_slices import dynamic_slices

    import executorch.backends.xnnpack.operators  # noqa: F401

    before = node_visitor._node_visitor_dict["aten.slice_copy.Tensor"]
    with pytest.raises(RuntimeError, match="boom"), dynamic_slices():
        assert node_visitor._node_visitor_dict["aten.slice_copy.Tensor"] is not before
        raise RuntimeError("boom")
    assert node_visitor._node_visitor_dict["aten.slice_copy.Tensor"] is before
