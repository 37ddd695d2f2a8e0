"""A mixture of experts through the stages (tiny Mixtral, 2 blocks of 4 experts, top-2): ptq_int8
quantizes every expert's Linears (none stays fp32 in a fused 3-D weight), GPTQ's Hessians are each
expert's routed tokens only, the equalization folds scale the router with the experts and stay
exact, and what cannot be split is refused before any work."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from optimize.stage_api import StageContext, get_stage
from targets.moe import expert_linears, fused_expert_params, unfuse_experts

EXPERTS, TOP_K, BLOCKS = 4, 2, 2


@pytest.fixture(scope="module")
def mixtral():
    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    return family("mixtral")


@pytest.fixture(scope="module")
def windows():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, 500, (64,), generator=gen) for _ in range(3)]


def _run(kind: str, model, windows, **opts):
    spec = get_stage(kind)
    ctx = StageContext(tokenizer=None, calibration=list(windows), train_ids=torch.cat(windows), target=None,
                       work_dir=Path("."), log=lambda s: None)
    return spec.fn(model, spec.config_cls.model_validate({"kind": kind, **opts}), ctx), ctx.details


def _quantized(model) -> list[str]:
    from optimize.stages.ptq_plan import is_quantized

    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_quantized(m.weight)]


@pytest.mark.parametrize("algorithm", ["rtn", "gptq"])
def test_ptq_int8_quantizes_every_expert_linear(mixtral, windows, algorithm):
    model, details = _run("ptq_int8", copy.deepcopy(mixtral), windows, scheme="8da4w", algorithm=algorithm)
    experts = expert_linears(model)
    assert len(experts) == BLOCKS * EXPERTS * 3  # gate, up, down per expert
    assert set(experts) <= set(_quantized(model))
    assert fused_expert_params(model) == []
    assert not any(p.dim() == 3 for p in model.parameters())  # nothing left fp32 in a fused weight
    assert details["experts"] == {"blocks_unfused": BLOCKS, "expert_linears": 24, "expert_linears_quantized": 24,
                                  "routers_kept_fp32": ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]}
    assert details["linear_quantized"] == 24 + BLOCKS * 4  # and q/k/v/o; lm_head kept
    if algorithm == "gptq":
        assert details["gptq"]["expert_linears"] == 24
    with torch.no_grad():
        ids = windows[0][None]
        ref, out = mixtral(ids).logits, model(ids).logits
    assert float((out - ref).norm() / ref.norm()) < 0.2


def _routed_tokens(model, ids) -> dict[str, int]:
    """Tokens the router sends to each expert of each block, read from the routers' own outputs."""
    counts: dict[str, int] = {}
    hooks = []
    for name, m in model.named_modules():
        if type(m).__name__ == "MixtralTopKRouter":
            def fn(_m, _a, out, block=name.rpartition(".")[0]):
                idx = out[2]
                for e in range(EXPERTS):
                    counts[f"{block}.experts.{e}"] = counts.get(f"{block}.experts.{e}", 0) + int((idx == e).sum())
            hooks.append(m.register_forward_hook(fn))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return counts


def test_each_expert_hessian_sees_only_its_routed_tokens(mixtral, windows):
    from optimize.quant.calibration_hooks import HessianCollector

    model = copy.deepcopy(mixtral)
    unfuse_experts(model)
    ids = windows[0][None]
    routed = _routed_tokens(model, ids)
    assert sum(routed.values()) == BLOCKS * TOP_K * ids.numel()
    names = expert_linears(model)
    collector = HessianCollector(model, names)
    with torch.no_grad():
        model(ids)
    collector.close()
    for name in names:
        expert = name.rpartition(".")[0]
        assert collector.tokens.get(name, 0) == routed[expert], name
    # gate and up read the very same routed rows; down reads another activation
    e = "model.layers.1.mlp.experts.3"
    assert torch.equal(collector.h[f"{e}.gate_proj"], collector.h[f"{e}.up_proj"])
    x = model.model.layers[1].mlp.experts[3]
    assert collector.h[f"{e}.down_proj"].shape == (x.down_proj.in_features,) * 2


def test_gptq_rounds_an_expert_without_tokens_to_nearest(mixtral, windows):
    """An expert no calibration token reaches gets an identity Hessian (GPTQ = round to nearest),
    not a zero one (whose "dead" columns GPTQ would zero)."""
    from optimize.quant.fakequant import scheme_for
    from optimize.quant.gptq_sequential import gptq_model

    model = copy.deepcopy(mixtral)
    unfuse_experts(model)
    def never_three(_m, _args, out):  # the router's top-2 among experts 0-2 only
        logits = out[0].masked_fill(torch.arange(EXPERTS) == 3, float("-inf"))
        weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), index

    model.model.layers[0].mlp.gate.register_forward_hook(never_three)
    silent = model.model.layers[0].mlp.experts[3]
    before = silent.down_proj.weight.detach().clone()
    scheme = scheme_for("8da8w", None)
    names = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in ("gate_proj", "up_proj", "down_proj")]
    res = gptq_model(model, dict.fromkeys(names, scheme), windows[:1])
    summary = res.summary()
    assert summary["expert_linears_without_tokens"] == [f"model.layers.0.mlp.experts.3.{p}"
                                                         for p in ("down_proj", "gate_proj", "up_proj")]
    # round to nearest on GPTQ's grid: every weight within half a step of itself (no error carried
    # across columns), none zeroed
    step = res.layers["model.layers.0.mlp.experts.3.down_proj"].scale.float()  # [rows, 1]: per channel
    assert ((silent.down_proj.weight - before).abs() <= step / 2 + 1e-7).all()
    assert (silent.down_proj.weight != 0).float().mean() > 0.9


@pytest.mark.parametrize("kind", ["smoothquant", "awq"])
def test_folds_scale_router_and_experts_exactly(mixtral, windows, kind):
    model, details = _run(kind, copy.deepcopy(mixtral), windows)
    assert details["exactness"]["relative_diff"] <= 1e-5
    groups = details["fold_groups"] if kind == "smoothquant" else details["groups"]
    # per block: qkv, o, one gate_up (router + 8 expert Linears), one down per expert
    assert groups == BLOCKS * (3 + EXPERTS)
    if kind == "smoothquant":  # the router's columns carry the norm's scales: its weight changed
        assert not torch.equal(model.model.layers[0].mlp.gate.weight, mixtral.model.layers[0].mlp.gate.weight)


def test_preflight_plans_the_experts_and_refuses_what_cannot_be_split(mixtral):
    from optimize.stages.ptq_config import Ptq8Config
    from optimize.stages.ptq_plan import plan

    cfg = Ptq8Config(scheme="8da4w", group_size=32)
    assert cfg.check_model(mixtral.config, None) == []
    odd = Ptq8Config(scheme="8da4w", group_size=96)  # divides neither 64 nor the experts' 128
    assert "group" in odd.check_model(mixtral.config, None)[0]
    with pytest.raises(ValueError, match=r"expert weights fused in 3-D parameters .* would stay fp32"):
        plan(mixtral, keep_high_precision=["lm_head"], modules=None, int8_modules=[], group_size=32,
             quantize_embedding=None, embedding_group_size=32)
    rotate = get_stage("rotate").config_cls.model_validate({"kind": "rotate"})
    assert "router" in rotate.check_model(mixtral.config, None)[0]
