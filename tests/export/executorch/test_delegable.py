"""The rewrites that keep a decoder layer inside XNNPACK change no number."""

from __future__ import annotations


import pytest
import torch

from export.executorch.delegable import static_reshapes


def _tiny(model_type: str, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                               **over)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _decoder_graph(model):
    from export.executorch.delegable import swap_rms_norms
    from export.executorch.llm import ExecuTorchDecoder, plan_layers

    swap_rms_norms(model)
    seq = torch.export.Dim("seq_len", min=1, max=32)
    dec = ExecuTorchDecoder(model, plan_layers(model.config, 48)).eval()
    with torch.no_grad():
        return torch.export.export(dec, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                   dynamic_shapes=({1: seq}, {0: seq}), strict=True)


def _two_calls(ep) -> list[torch.Tensor]:
    """Logits of a 9-token prefill and one decode step. Each run writes positions 0..9 of the
    cache before reading them, so runs before and after a rewrite start equal."""
    m = ep.module()
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return [m(ids, torch.arange(9)), m(ids[:, :1], torch.tensor([9]))]


def test_static_reshapes_keep_the_program_exact():
    """After the rewrite no reshape carries a symbolic size (XNNPACK refuses those), and the
    exported program computes the same logits at two sequence lengths."""
    ep = _decoder_graph(_tiny("qwen2"))

    def symbolic_reshapes(ep):
        return [n for n in ep.graph.nodes if n.op == "call_function" and n.target in (
            torch.ops.aten.view.default, torch.ops.aten.unsqueeze.default)
            and (n.target == torch.ops.aten.unsqueeze.default or not all(isinstance(d, int) for d in n.args[1]))]

    before = _two_calls(ep)
    assert symbolic_reshapes(ep)
    assert static_reshapes(ep) > 0
    assert not symbolic_reshapes(ep)
    for a, b in zip(before, _two_calls(ep)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["phi3", "gpt2"])
def test_splits_become_slices_and_the_program_stays_exact(model_type):
    """Phi-3's fused qkv / gate_up (chunk) and its full-width rotary's empty concatenation, GPT-2's
    c_attn split: afterwards no split, alias or zero-width cat input is left, and the program
    computes the same logits at two lengths."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from export.executorch.delegable import split_as_slices

    if model_type == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    else:
        cfg = AutoConfig.for_model("phi3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0)
    torch.manual_seed(0)
    ep = _decoder_graph(AutoModelForCausalLM.from_config(cfg).eval())

    def leftovers(ep):
        out = []
        for n in ep.graph.nodes:
            if n.op != "call_function":
                continue
            if "split" in str(n.target) or "chunk" in str(n.target) or n.target is torch.ops.aten.alias.default:
                out.append(n.name)
            if n.target is torch.ops.aten.cat.default and any(p.meta["val"].shape[n.args[1]] == 0 for p in n.args[0]):
                out.append(n.name)
        return out

    before = _two_calls(ep)
    assert leftovers(ep)
    assert split_as_slices(ep) > 0
    assert not leftovers(ep), leftovers(ep)
    assert any(n.target is torch.ops.aten.slice.Tensor for n in ep.graph.nodes)
    for a, b in zip(before, _two_calls(ep)):
        assert torch.equal(a, b)
