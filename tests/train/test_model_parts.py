"""One decoder-block lookup for every feature (checkpointing, FSDP, GPTQ, folds, sensitivity, GQA),
across architecture families, and weightless models for pre-flight checks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from train.model_parts import block_of, decoder_blocks, meta_model

V = 256
CONFIGS = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, vocab_size=V),
    "phi3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, vocab_size=V,
                 pad_token_id=0),
    "gemma2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=16,
                   vocab_size=V),
    "gpt2": dict(n_embd=32, n_layer=3, n_head=2, vocab_size=V),
    "opt": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, ffn_dim=64, vocab_size=V,
                word_embed_proj_dim=32),
    "gpt_neox": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, vocab_size=V),
}
PREFIX = {"gpt2": "transformer.h", "opt": "model.decoder.layers", "gpt_neox": "gpt_neox.layers"}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_decoder_blocks_in_order_for_every_family(model_type):
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    model = meta_model(config)
    assert all(p.is_meta for p in model.parameters())
    prefix = PREFIX.get(model_type, "model.layers")
    blocks = decoder_blocks(model)
    assert [n for n, _ in blocks] == [f"{prefix}.{i}" for i in range(3)]
    assert all(model.get_submodule(n) is m for n, m in blocks)
    names = [n for n, _ in blocks]
    assert block_of(f"{prefix}.1.mlp.x", names) == f"{prefix}.1" and block_of("lm_head", names) is None


def test_wrappers_and_plain_module_lists():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIGS["llama"]))
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])  # activation checkpointing wraps blocks
    assert [type(m).__name__ for _, m in decoder_blocks(model)] == ["LlamaDecoderLayer"] * 3
    plain = torch.nn.Sequential(torch.nn.Embedding(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4)] * 2))
    assert [n for n, _ in decoder_blocks(plain)] == ["1.0", "1.1"]
    assert decoder_blocks(torch.nn.Linear(2, 2)) == []
