"""A mixture of experts split into per-expert Linears (targets/moe.py): the same function as
transformers' fused experts, routed and dense, on a tiny Mixtral (4 experts, top-2).

Tolerance: both forms are asserted within ``TOL`` (1e-5) of the fused model's logits, relative to
their largest magnitude; on this CPU they came out bit-identical (max difference 0.0)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from targets.moe import (ExpertsRefused, UnfusedExperts, dense_experts, expert_linears, export_form,
                         fused_expert_params, routers, unfuse_experts)

TOL = 1e-5


@pytest.fixture(scope="module")
def mixtral():
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import TINY_CONFIGS

    kw = {**TINY_CONFIGS["mixtral"], "vocab_size": 512}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _close(a, b) -> float:
    diff = float((a - b).abs().max())
    assert diff <= TOL * max(1.0, float(b.abs().max())), diff
    return diff


def test_unfused_routed_and_dense_compute_the_fused_function(mixtral, ids):
    ref = _logits(mixtral, ids)
    model = copy.deepcopy(mixtral)
    assert unfuse_experts(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert fused_expert_params(model) == [] and unfuse_experts(model) == []  # idempotent
    assert len(expert_linears(model)) == 2 * 4 * 3
    assert routers(model) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    _close(_logits(model, ids), ref)
    dense = copy.deepcopy(model)
    assert len(dense_experts(dense)) == 2
    _close(_logits(dense, ids), ref)
    # expert e's gate/up rows are the two halves of gate_up_proj[e]
    fused = mixtral.model.layers[1].mlp.experts
    e2 = model.model.layers[1].mlp.experts[2]
    assert torch.equal(torch.cat([e2.gate_proj.weight, e2.up_proj.weight]), fused.gate_up_proj[2])
    assert torch.equal(e2.down_proj.weight, fused.down_proj[2])


def test_dense_form_equals_routed_form_when_some_experts_get_no_token():
    torch.manual_seed(1)
    experts = UnfusedExperts([_expert() for _ in range(4)])
    x = torch.randn(6, 32)
    index = torch.tensor([[0, 2]] * 6)  # experts 1 and 3 get nothing
    weights = torch.rand(6, 2).softmax(-1)
    routed = experts(x, index, weights)
    experts.dense = True
    _close(experts(x, index, weights), routed)


def _expert():
    from targets.moe import ExpertMLP

    return ExpertMLP(torch.randn(64, 32), torch.randn(64, 32), torch.randn(32, 64), nn.SiLU())


def test_export_form_is_dense_inside_and_leaves_the_model_as_it_was(mixtral, ids):
    ref = _logits(mixtral, ids)
    before = mixtral.model.layers[0].mlp.experts
    with export_form(mixtral) as names:
        assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        inside = mixtral.model.layers[0].mlp.experts
        assert isinstance(inside, UnfusedExperts) and inside.dense
        _close(_logits(mixtral, ids), ref)
    assert mixtral.model.layers[0].mlp.experts is before
    unfused = copy.deepcopy(mixtral)
    unfuse_experts(unfused)
    with export_form(unfused):
        assert unfused.model.layers[0].mlp.experts.dense
    assert not unfused.model.layers[0].mlp.experts.dense


def test_a_layout_it_cannot_split_is_refused_with_the_reason(mixtral):
    model = copy.deepcopy(mixtral)
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(ExpertsRefused, match=r"layers\.0\.mlp\.experts .*biases"):
        unfuse_experts(model)
    assert fused_expert_params(model)  # nothing was replaced: the check runs before any swap
    assert isinstance(model.model.layers[1].mlp.experts, type(mixtral.model.layers[1].mlp.experts))


def test_a_meta_model_unfuses_without_memory(mixtral):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(mixtral.config)
    unfuse_experts(meta)
    assert all(meta.get_submodule(n).weight.is_meta for n in expert_linears(meta))
