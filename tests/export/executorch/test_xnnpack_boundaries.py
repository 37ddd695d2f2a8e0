"""Residual adds as XNNPACK delegate boundaries (export/executorch/xnnpack_boundaries.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from export.executorch.xnnpack_boundaries import count_residual_adds, is_residual_add

HIDDEN = 16


class _Block(nn.Module):
    """A residual add, a per-head (RoPE-like) add, a scalar add and a bias-like add."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.bias = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):  # x: [B, T, HIDDEN]
        h = x + self.proj(x)                      # residual: two [B, T, HIDDEN]
        heads = h.view(1, -1, 2, HIDDEN // 2)
        heads = heads + heads.flip(-1)            # per head: 4-D
        eps = heads.pow(2).mean(-1, keepdim=True) + 1e-6  # scalar operand
        out = (heads * eps).reshape(1, -1, HIDDEN) + self.bias  # [HIDDEN] operand
        return out


def _adds(hidden: int = HIDDEN) -> list[bool]:
    ep = torch.export.export(_Block(), (torch.randn(1, 3, HIDDEN),))
    nodes = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.add.Tensor]
    return [is_residual_add(n, hidden) for n in nodes]


def test_only_the_residual_add_is_a_boundary():
    assert _adds() == [True, False, False, False]


class _Add(nn.Module):
    def forward(self, x, y):
        return x + y


def test_a_flattened_residual_add_is_a_boundary():
    """OPT adds its MLP output to the residual as ``[T, hidden]``."""
    ep = torch.export.export(_Add(), (torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)))
    node = next(n for n in ep.graph.nodes if n.op == "call_function")
    assert is_residual_add(node, HIDDEN) and not is_residual_add(node, HIDDEN + 1)


def test_another_width_is_not_a_boundary():
    assert _adds(hidden=HIDDEN * 2) == [False, False, False, False]


def test_count_in_a_graph():
    ep = torch.export.export(_Block(), (torch.randn(1, 3, HIDDEN),))
    assert count_residual_adds(ep.graph_module, HIDDEN) == 1
    assert count_residual_adds(ep.graph_module, HIDDEN + 1) == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_split_program_gives_the_same_logits(lower_variants, family):
    """Split at its residual adds, a layer runs as three XNNPACK calls with the two adds outside,
    and the program's logits equal the unsplit program's (an fp32 add is the same sum anywhere)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from export.verify import logits_parity

    layers = 2
    cfg = AutoConfig.for_model(family, vocab_size=256, hidden_size=64, intermediate_size=128, ffn_dim=128,
                               num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=64,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    runners, details = lower_variants(model, "split_layers", max_seq_len=32, quantize="8da4w", group_size=32)
    ids = torch.randint(3, 256, (32,), generator=torch.Generator().manual_seed(3))
    parity = logits_parity(runners[False], runners[True], [ids[:1], ids[:9], ids])
    assert parity["max_abs_diff"] < 1e-5 and parity["top1_agreement"] == 1.0, parity
    on, off = details[True], details[False]
    # two a layer (OPT also adds its position embeddings, flattened streams, the same way)
    assert on["llm_ops"]["residual_boundaries"] == 2 * layers if family == "llama" else \
        on["llm_ops"]["residual_boundaries"] > 2 * layers
    assert off["llm_ops"]["residual_boundaries"] == 0
    adds_on, adds_off = (d["delegation"]["portable_ops"].get("aten::add.out", 0) for d in (on, off))
    assert adds_on - adds_off == on["llm_ops"]["residual_boundaries"]  # OPT's integer position add is portable in both
    if family == "llama":  # one delegate a layer becomes three
        assert on["delegation"]["delegate_calls"] == off["delegation"]["delegate_calls"] + 2 * layers
    else:  # OPT's LayerNorms already split its layers
        assert on["delegation"]["delegate_calls"] > off["delegation"]["delegate_calls"]


class _GridBlock(nn.Module):
    """A residual add around a kept source grid's ``GroupOffsetLinear`` (``hidden -> hidden``, as
    ``o_proj``/``down_proj``), whose own offset add has the residual's shape."""

    def __init__(self):
        super().__init__()
        from export.group_offset import GroupOffsetLinear

        self.proj = GroupOffsetLinear(HIDDEN, HIDDEN, 8, bias=False)

    def forward(self, x):
        return x + self.proj(x)


@pytest.mark.parametrize("edge", [False, True], ids=["aten", "edge"])
def test_an_offset_add_inside_the_linear_is_not_a_boundary(edge):
    ep = torch.export.export(_GridBlock(), (torch.randn(1, 3, HIDDEN),))
    if edge:  # the partitioner sees the edge dialect, which must keep the module stack
        from executorch.exir import to_edge

        ep = to_edge(ep).exported_program()
    adds = [n for n in ep.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    assert len(adds) == 2
    # the offset add (inside GroupOffsetLinear.forward) comes first, the residual add last
    assert [is_residual_add(n, HIDDEN) for n in adds] == [False, True]
    assert count_residual_adds(ep.graph_module, HIDDEN) == 1
