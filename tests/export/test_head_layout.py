"""export/head_layout.py: the q/k/v transposes around RoPE cancel, and the values do not change.

Each family's decoder (with ExecuTorch's cache ops) is exported with ``torch.export`` only
(seconds). The rewritten graph must return bit-identical logits and cache contents where only
elementwise ops and slices lie between the transposes (it moves layout, not arithmetic); a
per-head RMSNorm's mean is a dot product over the head dim, which a GEMM may sum in another order
once the rows are laid out differently, so those families are held to 1e-5. The lowered
programs' parity with eager transformers is in test_executorch_llm.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from export.head_layout import cancel_head_transposes

aten = torch.ops.aten
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0)
#: family -> (model_type, overrides, transposes removed per layer, tolerance)
FAMILIES = {
    "llama": ("llama", {}, 6, 0.0),
    "qwen3": ("qwen3", {"head_dim": 16}, 6, 0.0),  # q/k RMSNorm before the transpose: not in the region
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 8}, 6, 1e-5),  # q/k RMSNorm after it
    "phi3-partial-rope": ("phi3", {"partial_rotary_factor": 0.5}, 6, 0.0),  # RoPE on half of each head
    # soft-capped attention multiplies q in [B, H, T, D]: only k's and v's transposes go
    "gemma2-softcap": ("gemma2", {"head_dim": 16, "sliding_window": 8}, 4, 0.0),
}
T = 5


def _exported(model_type: str, over: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from export.executorch_delegable import swap_rms_norms
    from export.executorch_llm import ExecuTorchDecoder, plan_layers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**BASE, **over})).eval()
    swap_rms_norms(model)
    dec = ExecuTorchDecoder(model, plan_layers(model.config, 16))
    seq = torch.export.Dim("seq_len", min=1, max=8)
    with torch.no_grad():
        return torch.export.export(dec, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                   dynamic_shapes=({1: seq}, {0: seq}), strict=True)


def _transposes(ep) -> int:
    return sum(n.target in (aten.transpose.int, aten.permute.default) for n in ep.graph.nodes)


def _run(ep, ids) -> list[torch.Tensor]:
    """Logits of a prefill then one step, and every cache buffer after them."""
    mod = ep.module()
    with torch.no_grad():
        out = [mod(ids[:, :T], torch.arange(T)), mod(ids[:, T:T + 1], torch.arange(T, T + 1))]
    return out + [b.clone() for name, b in mod.named_buffers() if "cache" in name]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rope_transposes_cancel_and_values_are_identical(family):
    model_type, over, per_layer, tol = FAMILIES[family]
    ids = torch.randint(0, BASE["vocab_size"], (1, T + 1), generator=torch.Generator().manual_seed(1))
    ref_ep, ep = _exported(model_type, over), _exported(model_type, over)
    before = _transposes(ep)
    removed = cancel_head_transposes(ep)
    assert removed == per_layer * BASE["num_hidden_layers"]
    assert _transposes(ep) == before - removed
    ref, got = _run(ref_ep, ids), _run(ep, ids)
    assert len(ref) == len(got) > 2
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=tol)
    assert cancel_head_transposes(ep) == 0  # nothing left to cancel


class _Heads(nn.Module):
    """[B, T, H*D] -> heads -> ``body`` in [B, H, T, D] -> back to [B, T, H*D]."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, other):
        h = x.view(1, x.shape[1], 4, 8).transpose(1, 2)
        return self.body(h, other).transpose(1, 2).reshape(1, x.shape[1], 32)


def _export_heads(body, other_shape):
    seq = torch.export.Dim("t", min=2, max=8)
    x, other = torch.randn(1, 3, 32), torch.randn(*other_shape)
    dims = [i for i, d in enumerate(other_shape) if d == 3]  # the operand's sequence dim, if any
    dyn = ({1: seq}, {dims[0]: seq} if dims else None)
    return torch.export.export(_Heads(body), (x, other), dynamic_shapes=dyn, strict=True), (x, other)


@pytest.mark.parametrize("body, other_shape, removed", [
    # RoPE-like: cos/sin [B, T, D] broadcast over heads, halves along the head dim
    (lambda h, o: h * o.unsqueeze(1) + torch.cat([-h[..., 4:], h[..., :4]], dim=-1) * o.unsqueeze(1), (1, 3, 8), 2),
    # a single-head operand that is not a view of a rank-3 tensor takes the one transpose left
    (lambda h, o: h * o, (1, 1, 3, 8), 1),
    # a per-head operand ([B, H, T, D] with H > 1) would need a real transpose: left alone
    (lambda h, o: h * o, (1, 4, 3, 8), 0),
    # a matmul over [B, H, T, D] depends on the layout: left alone
    (lambda h, o: h @ o, (8, 8), 0),
    # a slice along the sequence dim is not along the head dim: left alone
    (lambda h, o: torch.cat([h[:, :, :1] * 0, h[:, :, 1:]], dim=2) + o, (8,), 0),
])
def test_only_layout_agnostic_regions_are_rewritten(body, other_shape, removed):
    ep, args = _export_heads(body, other_shape)
    with torch.no_grad():
        ref = ep.module()(*args)
    assert cancel_head_transposes(ep) == removed
    with torch.no_grad():
        assert torch.equal(ep.module()(*args), ref)
