"""export/executorch/joint_rope.py: q and k rotated as one tensor, with the same values as apart."""

from __future__ import annotations

import pytest
import torch

from export.executorch.head_layout import cancel_head_transposes
from export.executorch.joint_rope import rope_q_and_k_together
from tests.export.conftest import DECODER_LAYERS as LAYERS, run_decoder

#: family -> (model_type, overrides, layers whose q and k share one RoPE chain)
FAMILIES = {
    "llama": ("llama", {}, LAYERS),
    "mistral": ("mistral", {}, LAYERS),
    "phi3": ("phi3", {}, LAYERS),  # qkv_proj fused in the checkpoint
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2}, 1),  # the NoPE layer has no chain
    # left alone: a per-head norm between the slice and RoPE, RoPE on part of each head
    "qwen3": ("qwen3", {"head_dim": 16}, 0),
    "phi3-partial-rope": ("phi3", {"partial_rotary_factor": 0.5}, 0),
}


def _ops(ep) -> int:
    return sum(n.op == "call_function" for n in ep.graph.nodes)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_q_and_k_share_one_rope_chain_with_identical_values(exported_decoder, family):
    model_type, over, layers = FAMILIES[family]
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    ref_ep, ep = exported_decoder(model_type, **over), exported_decoder(model_type, **over)
    for e in (ref_ep, ep):
        cancel_head_transposes(e)
    before = _ops(ep)
    assert rope_q_and_k_together(ep) == layers
    # per layer: two slices, two views and two 7-op chains become one slice, one view, one chain, two slices
    assert _ops(ep) == before - 7 * layers
    ref, got = run_decoder(ref_ep, ids), run_decoder(ep, ids)
    assert len(ref) == len(got) > 2
    for a, b in zip(ref, got):
        assert torch.equal(a, b), (a - b).abs().max()
    assert rope_q_and_k_together(ep) == 0
