"""The rewrites that keep a decoder layer inside XNNPACK change no number."""

from __future__ import annotations

import sys

import pytest
import torch

from export.executorch_delegable import rotate_half_as_linear, rotation_matrix, static_reshapes


@pytest.mark.parametrize("dim", [2, 16, 64, 96])
def test_rotation_matrix_is_rotate_half_bit_for_bit(dim):
    from transformers.models.llama.modeling_llama import rotate_half

    x = torch.randn(3, 5, 7, dim) * torch.logspace(-6, 6, dim)  # tiny to huge magnitudes
    assert torch.equal(torch.nn.functional.linear(x, rotation_matrix(dim)), rotate_half(x))


def test_odd_rotary_dim_is_refused():
    with pytest.raises(ValueError, match="even"):
        rotation_matrix(7)


def _tiny(model_type: str, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                               **over)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("model_type, over", [("llama", {}), ("qwen3", {"head_dim": 16}),
                                              ("phi3", {"partial_rotary_factor": 0.5})])
def test_patched_model_gives_the_same_logits_and_is_restored(model_type, over):
    model = _tiny(model_type, **over)
    mod = sys.modules[type(model).__module__]
    original = mod.rotate_half
    ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        owner = torch.nn.Module()
        with rotate_half_as_linear(model, owner) as patched:
            assert patched >= 1 and mod.rotate_half is not original
            got = model(ids).logits
    assert mod.rotate_half is original
    assert torch.equal(got, want)
    # partial RoPE rotates only part of each head: both sizes get a matrix
    dims = {int(n.rsplit("_", 1)[-1]) for n, _ in owner.named_buffers()}
    assert dims == ({16, 8} if model_type == "phi3" else {16})


def test_model_without_rope_is_left_alone():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with rotate_half_as_linear(model, torch.nn.Module()) as patched:
        assert patched == 0


def test_static_reshapes_keep_the_program_exact():
    """After the rewrite no reshape carries a symbolic size (XNNPACK refuses those), and the
    exported program computes the same logits at two sequence lengths."""
    from export.executorch_delegable import swap_rms_norms
    from export.executorch_llm import ExecuTorchDecoder, plan_layers

    model = _tiny("qwen2")
    swap_rms_norms(model)
    seq = torch.export.Dim("seq_len", min=1, max=32)
    dec = ExecuTorchDecoder(model, plan_layers(model.config, 48)).eval()
    with torch.no_grad():
        ep = torch.export.export(dec, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                 dynamic_shapes=({1: seq}, {0: seq}), strict=True)

    def symbolic_reshapes(ep):
        return [n for n in ep.graph.nodes if n.op == "call_function" and n.target in (
            torch.ops.aten.view.default, torch.ops.aten.unsqueeze.default)
            and (n.target == torch.ops.aten.unsqueeze.default or not all(isinstance(d, int) for d in n.args[1]))]

    # each pass writes positions 0..9 of the cache before reading them, so both start equal
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))

    def run(m):
        with torch.no_grad():
            return [m(ids, torch.arange(9)), m(ids[:, :1], torch.tensor([9]))]

    before = run(ep.module())
    assert symbolic_reshapes(ep)
    assert static_reshapes(ep) > 0
    assert not symbolic_reshapes(ep)
    for a, b in zip(before, run(ep.module())):
        assert torch.equal(a, b)
