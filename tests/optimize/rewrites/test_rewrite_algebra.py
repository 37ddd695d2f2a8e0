"""Pure weight algebra behind the rmsnorm and gqa stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.pytorch_utils import Conv1D

from optimize.rewrites.gqa import valid_kv_heads
from optimize.rewrites.layernorm_fold import fold_exact
from optimize.rewrites.linear import bias_or_zeros, set_bias, set_weight_out_in, weight_out_in
from optimize.rewrites.ln_plans import RewriteRefused, plan_for


def test_conv1d_and_linear_share_one_layout():
    torch.manual_seed(0)
    lin, conv = nn.Linear(6, 4), Conv1D(4, 6)
    with torch.no_grad():
        conv.weight.copy_(lin.weight.t())
        conv.bias.copy_(lin.bias)
    torch.testing.assert_close(weight_out_in(conv), weight_out_in(lin))
    x = torch.randn(3, 6)
    torch.testing.assert_close(conv(x), lin(x))
    w = weight_out_in(lin) * 2
    set_weight_out_in(conv, w)
    set_weight_out_in(lin, w)
    torch.testing.assert_close(conv(x), lin(x))


def test_set_bias_creates_missing_bias():
    lin = nn.Linear(3, 2, bias=False)
    assert bias_or_zeros(lin).tolist() == [0.0, 0.0]
    assert set_bias(lin, torch.tensor([1.0, 2.0], dtype=torch.float64)) is True
    assert lin.bias.dtype == torch.float32 and lin.bias.tolist() == [1.0, 2.0]


def test_layernorm_equals_rmsnorm_on_centred_input():
    """The identity the whole fold rests on, including eps."""
    x = torch.randn(5, 16, dtype=torch.float64) * 1e-3  # small, so eps matters
    x = x - x.mean(-1, keepdim=True)
    ln = nn.LayerNorm(16, eps=1e-5, elementwise_affine=False).double()
    rms = LlamaRMSNorm(16, eps=1e-5).double()
    torch.testing.assert_close(ln(x), rms(x))


def test_opt_without_affine_layernorms_folds_exactly():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("opt", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
                               vocab_size=128, max_position_embeddings=32, word_embed_proj_dim=32,
                               layer_norm_elementwise_affine=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        fold_exact(model, plan_for(model))
        assert (model(input_ids=ids).logits - ref).abs().max() <= 1e-5


def test_phi_qk_layernorm_is_refused():
    cfg = AutoConfig.for_model("phi", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, vocab_size=128, qk_layernorm=True)
    with pytest.raises(RewriteRefused, match="phi with qk_layernorm=True"):
        plan_for(AutoModelForCausalLM.from_config(cfg))


def test_valid_kv_heads():
    assert valid_kv_heads(3) == [1, 3]
    assert valid_kv_heads(8) == [1, 2, 4, 8]
