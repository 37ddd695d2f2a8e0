"""The lowering's shortcuts leave the program byte for byte what ExecuTorch alone writes.

:mod:`export.executorch.lowering_cost` skips XNNPACK passes that cannot apply to a delegate and
keeps provenance histories short. Both claims are checked by lowering the same model with and
without them and comparing the bytes (debug handles included), on two decoder families whose
graphs differ (Llama: GQA, RMSNorm, SiLU gate; GPT-2: fused ``c_attn``, LayerNorm, GELU), and on a
small CNN where some skipped passes do apply (convolution, batch norm, padding), so a predicate that
dropped a pass it should run would change the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch
from torch import nn

from export.executorch import lowering_cost
from tests.export.conftest import _Tok

pytestmark = pytest.mark.timeout(600)


@contextlib.contextmanager
def _stock_lowering(monkeypatch):
    """ExecuTorch's own lowering: every pass on every delegate, full provenance."""

    @contextlib.contextmanager
    def nothing(*_a, **_k):
        yield

    with monkeypatch.context() as m:
        m.setattr(lowering_cost, "applicable_passes_only", nothing)
        m.setattr(lowering_cost, "without_provenance", nothing)
        m.setattr(lowering_cost, "in_place_legalize", nothing)
        m.setattr(lowering_cost, "no_op_decompositions_skipped", nothing)
        yield


def _lower_llm(model) -> tuple[str, dict]:
    from export.executorch import ExecuTorchOptions, lower_to_pte

    opts = ExecuTorchOptions(quantize="8da4w", group_size=32, lm_head="8da8w", max_seq_len=32)
    data, details = lower_to_pte(model, _Tok(), opts, log=lambda *_: None)
    return hashlib.sha256(data).hexdigest(), details


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_an_llm_lowers_to_the_same_bytes_with_fewer_passes(family, tiny_config, monkeypatch):
    from targets.sources import RandomSource, load_model

    # one block, lowered twice: which passes apply is decided per node pattern, and every pattern a block has
    # (attention, norms, MLP, the residual adds) is in one of them
    one_block = {"n_layer": 1} if family == "gpt2" else {"num_hidden_layers": 1}
    model = load_model(RandomSource(config=tiny_config(family, **one_block), seed=0)).model
    ours, details = _lower_llm(model)
    with _stock_lowering(monkeypatch):
        stock, stock_details = _lower_llm(model)
    assert ours == stock
    skipped = details["llm_ops"]["xnnpack_passes_skipped"]
    # the decoder holds none of these operators: every delegate skips them
    for name in ("FuseBatchNormPass", "DecomposeBatchNorm", "Conv1dUnsqueezePass", "PReLUReshapePass",
                 "InsertPadQDQPass", "RemoveGetItemPass", "ConvertToSDPAPass", "ConvertToUpsampleBilinear2d",
                 "FuseActivationPass", "PropagateCustomMetaPass", "DimOrderOpsRevertPass"):
        # a decoder's every delegate skips each of them (XNNPACK's preprocess met each delegate once)
        assert skipped.get(name, 0) == details["delegation"]["delegated_subgraphs"], (name, skipped)
    assert max(skipped.values()) == details["delegation"]["delegated_subgraphs"], skipped
    assert stock_details["llm_ops"]["xnnpack_passes_skipped"] == {}  # the stock run skipped nothing
    # the third decomposition (after the partitioner set its operators aside) found nothing to do
    assert details["llm_ops"]["decompositions_skipped"] == 1
    assert stock_details["llm_ops"]["decompositions_skipped"] == 0


class _Vision(nn.Module):
    """Operators some of the skippable passes act on: padding, convolution (1-D and 2-D), batch
    norm, a ReLU after a convolution, a cat of six inputs; and PReLU and max-pooling, which reach XNNPACK as ``prelu``/``max_pool2d`` (not the
    ``_prelu_kernel``/``max_pool2d_with_indices`` those two passes rewrite), so they are skipped."""

    def __init__(self):
        super().__init__()
        self.conv1d = nn.Conv1d(4, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.prelu = nn.PReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        y = self.conv1d(x.flatten(2)).view_as(x)
        y = nn.functional.pad(y, (1, 1, 1, 1))
        y = self.pool(self.prelu(torch.relu(self.bn(self.conv(y)))))
        return torch.cat([y, y * 2, y + 1, y - 1, y * 3, y * 0.5], dim=1)


def _lower_vision(model) -> tuple[bytes, dict]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    ep = torch.export.export(model, (torch.randn(1, 4, 8, 8),), strict=True)
    skipped: dict[str, int] = {}
    with lowering_cost.applicable_passes_only(skipped), lowering_cost.without_provenance(), \
            lowering_cost.in_place_legalize(), lowering_cost.no_op_decompositions_skipped():
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    return edge.to_executorch().buffer, skipped


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_passes_whose_operators_are_present_still_run():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    torch.manual_seed(0)
    model = _Vision().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    ours, skipped = _lower_vision(model)
    stock = to_edge_transform_and_lower(torch.export.export(model, (torch.randn(1, 4, 8, 8),), strict=True),
                                        partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    assert hashlib.sha256(ours).hexdigest() == hashlib.sha256(stock).hexdigest()
    # what these graphs hold is not skipped; what they lack (SDPA, upsampling) is
    assert "ConvertToSDPAPass" in skipped and "ConvertToUpsampleBilinear2d" in skipped
    delegates = skipped["ConvertToSDPAPass"]  # no delegate holds an SDPA: each skipped it
    for name in ("Conv1dUnsqueezePass", "FuseBatchNormPass", "DecomposeBatchNorm", "InsertPadQDQPass",
                 "FuseActivationPass", "DecomposeConcatenate"):
        assert skipped.get(name, 0) < delegates, (name, skipped)  # some delegate ran it


@pytest.mark.parametrize("name, present, applies", [
    ("Conv1dUnsqueezePass", {"aten.convolution.default"}, True),
    ("Conv1dUnsqueezePass", {"aten.linear.default", "aten.add.Tensor"}, False),
    ("FuseBatchNormPass", {"aten._native_batch_norm_legit_no_training.default"}, True),
    ("DecomposeBatchNorm", {"aten.native_batch_norm.default"}, True),
    ("PReLUReshapePass", {"aten._prelu_kernel.default"}, True),
    ("InsertPadQDQPass", {"aten.constant_pad_nd.default"}, True),
    ("RemoveGetItemPass", {"aten.max.dim"}, True),
    ("RemoveGetItemPass", {"aten.amax.default"}, False),
    ("FuseActivationPass", {"aten.relu.default"}, True),
    ("FuseActivationPass", {"aten.silu.default", "aten.linear.default"}, False),
    ("ConvertToLinearPass", {"aten.addmm.default"}, True),
    ("ConvertToLinearPass", {"aten.linear.default"}, False),
    ("RemoveRedundantCopyPass", {"aten._to_copy.default"}, True),
    ("DecomposeConcatenate", {"aten.cat.default"}, True),
    ("DecomposeConcatenate", {"aten.add.Tensor"}, False),
    ("PropagateCustomMetaPass", {lowering_cost.CUSTOM_META}, True),
    ("PropagateCustomMetaPass", {"aten.linear.default"}, False),
    ("DimOrderOpsRevertPass", {"dim_order_ops._clone_dim_order.default"}, True),
    ("DimOrderOpsRevertPass", {"aten.clone.default"}, False),
    ("ChannelsLastTaggedReshapePass", set(), True),  # a pass without a rule always runs
    ("ConstPropPass", set(), True),
])
def test_a_pass_is_skipped_only_without_its_operators(name, present, applies):
    assert lowering_cost.may_apply(name, present) is applies


def test_a_pattern_pass_runs_where_its_pattern_can_match():
    from executorch.backends.xnnpack.partition.graphs import sdpa

    pattern_ops = lowering_cost._op_names(sdpa.get_graphs()[0].graph)
    assert lowering_cost.may_apply("ConvertToSDPAPass", pattern_ops | {"aten.add.Tensor"})
    assert not lowering_cost.may_apply("ConvertToSDPAPass", pattern_ops - {next(iter(pattern_ops))})


def test_the_stock_functions_come_back_even_after_an_error():
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from torch.fx import traceback as fx_traceback

    from executorch.exir import lowered_backend_module
    from torch.export import ExportedProgram

    pass_init, source_init = XNNPACKPassManager.__init__, fx_traceback.NodeSource.__init__
    legalize, decompose = lowered_backend_module.legalize_graph, ExportedProgram.run_decompositions
    with pytest.raises(RuntimeError):
        with lowering_cost.applicable_passes_only(), lowering_cost.without_provenance(), \
                lowering_cost.in_place_legalize(), lowering_cost.no_op_decompositions_skipped():
            assert XNNPACKPassManager.__init__ is not pass_init
            assert fx_traceback.NodeSource.__init__ is not source_init
            assert lowered_backend_module.legalize_graph is lowering_cost.legalize_in_place
            assert ExportedProgram.run_decompositions is not decompose
            raise RuntimeError("lowering failed")
    assert XNNPACKPassManager.__init__ is pass_init
    assert fx_traceback.NodeSource.__init__ is source_init
    assert lowered_backend_module.legalize_graph is legalize
    assert ExportedProgram.run_decompositions is decompose


def _scrambled():
    """A traced graph whose last two computing nodes were moved to the front (not topological)."""
    def f(x, y):
        a = torch.relu(x)
        b = a + 1  # operator.add: one of legalize_graph's prioritized operators
        c = torch.sigmoid(y) * b
        d = torch.cat([c, a, b])
        return d.sum() + b.mean()

    gm = torch.fx.symbolic_trace(f)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    first = next(iter(gm.graph.nodes))
    for n in nodes[-2:]:
        first.append(n)  # right after the first placeholder
    return gm


def test_legalize_in_place_reaches_legalize_graphs_order_without_copying():
    from torch.fx.passes.tools_common import legalize_graph

    want = [n.name for n in legalize_graph(_scrambled()).graph.nodes]
    gm = _scrambled()
    before = set(gm.graph.nodes)
    assert [n.name for n in gm.graph.nodes] != want  # scrambled: there is something to sort
    lowering_cost.legalize_in_place(gm)
    assert [n.name for n in gm.graph.nodes] == want
    assert set(gm.graph.nodes) == before  # the same node objects, moved
    gm.graph.lint()
    x, y = torch.randn(3), torch.randn(3)
    assert torch.allclose(gm(x, y), _reference(x, y))


def _reference(x, y):
    a = torch.relu(x)
    b = a + 1
    c = torch.sigmoid(y) * b
    return torch.cat([c, a, b]).sum() + b.mean()


def test_legalize_in_place_refuses_a_cycle():
    gm = _scrambled()
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    last = gm.graph.output_node().args[0]
    relu.args = (last,)  # relu now reads the graph's last computation, which reads relu
    with pytest.raises(RuntimeError, match="cycles"):
        lowering_cost.legalize_in_place(gm)
