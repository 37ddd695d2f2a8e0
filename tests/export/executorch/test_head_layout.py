"""export/executorch/head_layout.py: the q/k/v transposes around RoPE cancel, and the values do not change.

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

from export.executorch.head_layout import cancel_head_transposes
from tests.export.conftest import DECODER_LAYERS as LAYERS, run_decoder

aten = torch.ops.aten
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


def _transposes(ep) -> int:
    return sum(n.target in (aten.transpose.int, aten.permute.default) for n in ep.graph.nodes)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_rope_transposes_cancel_and_values_are_identical(exported_decoder, family):
    model_type, over, per_layer, tol = FAMILIES[family]
    ids = torch.randint(0, 256, (1, T + 1), generator=torch.Generator().manual_seed(1))
    ref_ep, ep = exported_decoder(model_type, **over), exported_decoder(model_type, **over)
    before = _transposes(ep)
    removed = cancel_head_transposes(ep)
    assert removed == per_layer * LAYERS
    assert _transposes(ep) == before - removed
    ref, got = run_decoder(ref_ep, ids), run_decoder(ep, ids)
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
