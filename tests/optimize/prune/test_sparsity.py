"""Unstructured and 2:4 sparsity: the masks keep what the score says, the stage zeroes exactly
that share of every row (lm_head untouched), and a fine-tune afterwards keeps the zeros."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from optimize.finetune import FinetuneConfig, finetune
from optimize.prune.records import sparse_masks
from optimize.prune.sparsity import is_n_of_m, n_of_m_mask, row_mask
from optimize.stage_api import StageContext, get_stage
from optimize.stages.prune import NO_SPARSE_GAIN, PruneConfig

V = 128
CALIB = [torch.randint(0, V, (48,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
TRAIN = torch.randint(0, V, (2000,), generator=torch.Generator().manual_seed(4))


def tiny(model_type: str = "llama"):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    return AutoModelForCausalLM.from_config(cfg).eval()


def ctx():
    return StageContext(tokenizer=None, calibration=CALIB, train_ids=TRAIN, target=None, work_dir=None,
                        log=lambda s: None)


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}


def test_masks_keep_the_highest_scores():
    score = torch.tensor([[4.0, 1.0, 3.0, 2.0, 0.5, 9.0, 8.0, 7.0]])
    assert row_mask(score, 0.25).tolist() == [[True, False, True, True, False, True, True, True]]
    assert n_of_m_mask(score).tolist() == [[True, False, True, False, False, True, True, False]]
    with pytest.raises(ValueError, match="2:4 sparsity needs in_features divisible by 4, got 6"):
        n_of_m_mask(torch.ones(2, 6))


def test_wanda_weighs_by_activation_norms_magnitude_does_not():
    """Input channel 0 carries large activations: Wanda keeps its small weights, magnitude drops them."""
    model = tiny()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] *= 50
    kept = {}
    for kind in ("magnitude", "wanda"):
        m = get_stage("prune").fn(copy.deepcopy(model), PruneConfig(method="unstructured", sparsity=0.5, score=kind,
                                                                     modules=["model.layers.0.self_attn.q_proj"]), ctx())
        kept[kind] = float((m.model.layers[0].self_attn.q_proj.weight[:, 0] != 0).float().mean())
    assert kept["wanda"] > kept["magnitude"] + 0.3, kept


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_unstructured_zeroes_that_share_of_every_row(family):
    model = tiny(family)
    params = sum(p.numel() for p in model.parameters())
    c = ctx()
    out = get_stage("prune").fn(model, PruneConfig(method="unstructured", sparsity=0.5), c)
    for name, lin in linears(out).items():
        per_row = (lin.weight == 0).float().mean(dim=1)
        assert torch.allclose(per_row, torch.full_like(per_row, 0.5)), name
    assert (out.lm_head.weight != 0).all()  # lm_head is never pruned
    assert sum(p.numel() for p in out.parameters()) == params  # same shapes: nothing is removed
    assert c.details["sparsity_achieved"] == pytest.approx(0.5, abs=1e-3)
    assert c.details["runtime_gain"] == NO_SPARSE_GAIN and "no size or speed gain" in NO_SPARSE_GAIN
    assert out.config.pruning[-1]["method"] == "unstructured"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_semi_structured_is_2_of_4_on_the_chosen_modules(family):
    model = tiny(family)
    out = get_stage("prune").fn(model, PruneConfig(method="semi_structured", modules=["*.mlp.*"]), ctx())
    for name, lin in linears(out).items():
        assert is_n_of_m(lin.weight) == (".mlp." in name), name
    assert out.config.pruning[-1]["modules"] == [n for n in linears(out) if ".mlp." in n]
    with torch.no_grad():
        assert torch.isfinite(out(input_ids=CALIB[0][None]).logits).all()


def test_finetune_keeps_pruned_weights_at_zero_unless_told_not_to():
    model = get_stage("prune").fn(tiny(), PruneConfig(method="semi_structured", score="magnitude"), ctx())
    masks = sparse_masks(model)
    assert len(masks) == len(linears(model))
    cfg = dict(loss="lm", steps=3, seq_len=32, optimizer={"lr": 1e-2, "weight_decay": 0.1},
               batch={"micro_batch_size": 2})
    kept = copy.deepcopy(model)
    facts = finetune(kept, FinetuneConfig(**cfg), TRAIN, log=lambda s: None)
    refilled = copy.deepcopy(model)
    finetune(refilled, FinetuneConfig(**cfg, keep_sparsity=False), TRAIN, log=lambda s: None)
    for name, mask in masks.items():
        w = dict(kept.named_parameters())[name]
        assert (w[~mask] == 0).all() and is_n_of_m(w), name
        assert not torch.equal(w, dict(model.named_parameters())[name])  # the kept weights did train
    assert facts["sparse_weights_kept_zero"] == sum(int((~m).sum()) for m in masks.values())
    assert any((dict(refilled.named_parameters())[n][~m] != 0).any() for n, m in masks.items())
