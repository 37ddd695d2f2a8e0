"""Structured pruning surgery on every supported family: the smaller model computes exactly
what the original computes with the removed parts switched off, its config says its new shape,
and it reloads with ``from_pretrained``. Importance scores pick what a constructed case makes
worthless, and removing it leaves the logits unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from optimize.prune import importance as imp
from optimize.prune.arch import shape
from optimize.prune.structured import drop_blocks, slice_width
from optimize.stage_api import StageContext, get_stage
from optimize.stages.prune import PruneConfig

V = 128
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text"]
IDS = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
CALIB = [torch.randint(0, V, (48,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]


def tiny(model_type: str, *, layers: int = 3, heads: int = 4, kv: int = 2, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    if model_type in ("qwen3", "gemma", "gemma2", "gemma3_text"):
        kw.setdefault("head_dim", 16)
    if model_type == "qwen2":
        kw.setdefault("attention_bias", True)  # Qwen2's q/k/v biases must be sliced with their rows
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    with torch.no_grad():  # larger weights than the 0.02 default, so a wrong slice shows in the logits
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    return model


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def ctx(calibration=CALIB) -> StageContext:
    return StageContext(tokenizer=None, calibration=calibration, train_ids=None, target=None, work_dir=None,
                        log=lambda s: None)


def reloads_identically(model, tmp_path) -> None:
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(logits(again), logits(model), rtol=0, atol=1e-6)
    assert again.config.num_hidden_layers == model.config.num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_depth_equals_skipping_the_dropped_blocks(family, tmp_path):
    model = tiny(family)
    keep = [0, 2]
    skip = model.model.layers[1].register_forward_hook(
        lambda _m, args, kwargs, out: kwargs.get("hidden_states", args[0] if args else None), with_kwargs=True)
    reference = logits(model)
    skip.remove()
    pruned = drop_blocks(model, keep)
    assert pruned.config.num_hidden_layers == 2 and len(pruned.model.layers) == 2
    assert [l.self_attn.layer_idx for l in pruned.model.layers] == [0, 1]  # KV-cache slots renumbered
    if getattr(model.config, "layer_types", None):
        assert pruned.config.layer_types == [model.config.layer_types[i] for i in keep]
    per_block = sum(p.numel() for p in model.model.layers[1].parameters())
    assert sum(p.numel() for p in pruned.parameters()) == sum(p.numel() for p in model.parameters()) - per_block
    torch.testing.assert_close(logits(pruned), reference, rtol=0, atol=1e-5)
    reloads_identically(pruned, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_width_equals_zeroing_the_removed_heads_and_channels(family, tmp_path):
    """Removing query heads, a whole KV group and MLP channels == zeroing their o_proj / down_proj
    columns in the original (phi3: fused qkv and gate_up slices; qwen2: q/k/v biases)."""
    model = tiny(family, heads=4, kv=2)
    d = shape(model.config)["head_dim"]
    kept_heads = [[2], [3]] + [[2]]       # per block: one query head of KV group 1
    kept_kv = [[1], [1], [1]]
    g = torch.Generator().manual_seed(7)
    kept_ch = [torch.sort(torch.randperm(128, generator=g)[:96]).values for _ in range(3)]
    masked = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(masked.model.layers):
            for h in range(4):
                if h not in kept_heads[i]:
                    layer.self_attn.o_proj.weight[:, h * d:(h + 1) * d] = 0
            drop = torch.ones(128, dtype=torch.bool)
            drop[kept_ch[i]] = False
            layer.mlp.down_proj.weight[:, drop] = 0
    pruned = slice_width(model, kept_heads, kept_kv, kept_ch)
    c = pruned.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.head_dim) == (1, 1, 96, d)
    layer = pruned.model.layers[0]
    if family == "phi3":
        assert layer.self_attn.qkv_proj.weight.shape == (3 * d, 64)
        assert layer.mlp.gate_up_proj.weight.shape == (2 * 96, 64)
    else:
        assert layer.self_attn.q_proj.weight.shape == (d, 64) and layer.self_attn.k_proj.weight.shape == (d, 64)
        assert layer.mlp.up_proj.weight.shape == (96, 64)
    assert layer.self_attn.o_proj.weight.shape == (64, d) and layer.mlp.down_proj.weight.shape == (64, 96)
    torch.testing.assert_close(logits(pruned), logits(masked), rtol=0, atol=2e-5)
    reloads_identically(pruned, tmp_path)


def test_zero_importance_channel_is_removed_with_no_change_in_logits():
    """In float64, so "the same logits" means equal to rounding (1e-12), not to float32 noise."""
    model = tiny("llama").double()
    c = 37
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[c] = 0  # silu(gate) * up == 0 on every token: importance 0
    _, chans = imp.width_importance(model, CALIB)
    assert (chans[:, c] == 0).all() and (chans.min(dim=1).values == 0).all()
    cfg = PruneConfig(method="width", mlp_ratio=1 / 128, channel_multiple=1)
    pruned = get_stage("prune").fn(copy.deepcopy(model), cfg, ctx())
    assert pruned.config.intermediate_size == 127 and pruned.model.layers[0].mlp.up_proj.weight.dtype == torch.float64
    torch.testing.assert_close(logits(pruned), logits(model), rtol=0, atol=1e-12)


def test_zero_importance_head_group_is_removed_with_no_change_in_logits():
    model = tiny("qwen2", heads=4, kv=4).double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight[16:32] = 0  # head 1 outputs zero on every token
            layer.self_attn.v_proj.bias[16:32] = 0
    heads, _ = imp.width_importance(model, CALIB)
    assert (heads[:, 1] == 0).all()
    cfg = PruneConfig(method="width", num_attention_heads=3, num_key_value_heads=3)
    pctx = ctx()
    pruned = get_stage("prune").fn(copy.deepcopy(model), cfg, pctx)
    assert pctx.details["kept_heads"] == [[0, 2, 3]] * 3
    torch.testing.assert_close(logits(pruned), logits(model), rtol=0, atol=1e-12)


def test_an_identity_block_has_zero_influence_and_goes_first():
    model = tiny("qwen3", layers=4)
    with torch.no_grad():  # block 2 adds nothing to the residual stream: output == input
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    scores = imp.block_influence(model, CALIB)
    assert abs(scores[2]) < 1e-6 and min(s for i, s in enumerate(scores) if i != 2) > 1e-3
    pctx = ctx()
    pruned = get_stage("prune").fn(copy.deepcopy(model), PruneConfig(method="depth", num_hidden_layers=3), pctx)
    assert pctx.details["removed_blocks"] == [2] and pruned.config.pruning[-1]["kept_layers"] == [0, 1, 3]
    torch.testing.assert_close(logits(pruned), logits(model), rtol=0, atol=1e-5)


def test_loss_score_is_the_calibration_loss_rise_and_drops_the_cheapest_block():
    model = tiny("mistral", layers=4)
    base = imp.calibration_loss(model, CALIB)
    scores = imp.block_loss_increase(model, CALIB)
    by_hand = []
    for i in range(4):
        pruned = drop_blocks(model, [j for j in range(4) if j != i])
        by_hand.append(imp.calibration_loss(pruned, CALIB) - base)
    assert scores == pytest.approx(by_hand, abs=1e-5)
    pctx = ctx()
    get_stage("prune").fn(copy.deepcopy(model), PruneConfig(method="depth", num_hidden_layers=3, block_score="loss"), pctx)
    assert pctx.details["removed_blocks"] == [min(range(4), key=scores.__getitem__)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3"])
def test_residual_channels_nothing_writes_to_are_removed_exactly(family, tmp_path):
    """Embedding columns C zero and no o_proj/down_proj row writes them: those channels are 0
    everywhere, their importance is 0, and removing them (norm weights rescaled by sqrt(H/H'))
    keeps the logits. 60 of 64 channels: Llama's config wants the 4 heads to divide hidden_size."""
    model = tiny(family, rms_norm_eps=1e-12).double()  # so the comparison sees the surgery, not eps
    dead = [5, 17, 33, 50]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, dead] = 0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[dead] = 0
            layer.mlp.down_proj.weight[dead] = 0
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias[dead] = 0
    assert (imp.hidden_importance(model, CALIB)[dead] == 0).all()
    pctx = ctx()
    pruned = get_stage("prune").fn(copy.deepcopy(model), PruneConfig(method="width", hidden_size=60), pctx)
    assert pruned.config.hidden_size == 60 and pctx.details["hidden_size"] == [64, 60]
    assert pruned.model.embed_tokens.weight.shape == (V, 60) and pruned.lm_head.weight.shape == (V, 60)
    assert set(pruned.config.pruning[-1]["kept_hidden"]) == set(range(64)) - set(dead)
    # HF's RMSNorm computes in float32 even in a float64 model: equal to float32 precision
    torch.testing.assert_close(logits(pruned), logits(model), rtol=0, atol=2e-5)
    reloads_identically(pruned, tmp_path)


def test_hidden_pruning_refuses_gemma():
    msg = PruneConfig(method="width", hidden_size=32).check_model(tiny("gemma").config, None)
    assert msg == ["hidden_size pruning is not supported for gemma: its embeddings are scaled by sqrt(hidden_size) "
                   "and tied to the output head; prune heads, MLP channels or depth"]
