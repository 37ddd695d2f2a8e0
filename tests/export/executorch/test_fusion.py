"""q/k/v and gate/up as one GEMM each: exact in eager, bit-identical quantized weights, one
linear per group in the exported graph, and the same logits from the .pte as without fusion."""

from __future__ import annotations

import copy

import pytest
import torch

from export.executorch.fusion import FUSED_ATTR, ProjectionSlice, fuse_projections, member_path, merge_duplicate_linears

pytestmark = pytest.mark.timeout(900)

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: family -> (config overrides, q/k/v groups per layer, gate/up groups per layer)
FAMILIES = {
    "llama": ({"num_key_value_heads": 2}, 1, 1),
    "qwen2": ({"num_key_value_heads": 2}, 1, 1),  # q/k/v biases
    "qwen3": ({"num_key_value_heads": 2, "head_dim": 16}, 1, 1),  # per-head q/k norms after the split
    "mistral": ({"num_key_value_heads": 2}, 1, 1),
    "gemma": ({"num_key_value_heads": 2, "head_dim": 16}, 1, 1),
    "opt": ({"ffn_dim": 128}, 1, 0),  # q/k/v with biases, no gated MLP
    "phi3": ({"num_key_value_heads": 2}, 0, 0),  # already fused in the checkpoint
}


def _model(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    over, _, _ = FAMILIES[model_type]
    cfg = AutoConfig.for_model(model_type, **{**BASE, **over, **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_model_gives_the_same_logits(family):
    model = _model(family)
    fused = copy.deepcopy(model)
    info = fuse_projections(fused)
    _, qkv, gate_up = FAMILIES[family]
    layers = BASE["num_hidden_layers"]
    assert info == {"fused": {"q_proj+k_proj+v_proj": qkv * layers, "gate_proj+up_proj": gate_up * layers},
                    "left_apart": 0}, info
    ids = torch.randint(3, 256, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits, fused(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    if qkv:
        attn, orig = (next(m for m in x.modules() if hasattr(m, "q_proj")) for x in (fused, model))
        members = [attn.q_proj, attn.k_proj, attn.v_proj]
        assert all(isinstance(m, ProjectionSlice) for m in members)
        assert len({id(getattr(m, FUSED_ATTR)) for m in members}) == 1  # one shared Linear
        assert [m.out_features for m in members] == [orig.q_proj.out_features, orig.k_proj.out_features,
                                                     orig.v_proj.out_features]


def _quantize(model, fqn_filter=None):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_

    cfg = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    quantize_(model, cfg, fqn_filter or (lambda m, fqn: isinstance(m, torch.nn.Linear) and "lm_head" not in fqn))


def test_quantized_weights_are_concatenated_bit_for_bit():
    model = _model("llama")
    _quantize(model)
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    x = torch.randn(1, 5, BASE["hidden_size"])
    with torch.no_grad():
        want = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    fuse_projections(model)
    fused = getattr(attn.q_proj, FUSED_ATTR).weight
    assert type(fused).__name__ == "IntxUnpackedToInt8Tensor" and fused.target_dtype == torch.int4
    for name in ("qdata", "scale", "zero_point"):
        assert torch.equal(getattr(fused, name), torch.cat([getattr(p, name) for p in parts]))
    with torch.no_grad():
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_group_of_mixed_schemes_stays_apart():
    model = _model("llama")
    # only q_proj of layer 0 quantized: its group cannot be one GEMM; everything else fuses
    _quantize(model, lambda m, fqn: fqn == "model.layers.0.self_attn.q_proj")
    info = fuse_projections(model)
    assert info == {"fused": {"q_proj+k_proj+v_proj": 1, "gate_proj+up_proj": 2}, "left_apart": 1}
    assert type(model.model.layers[0].self_attn.k_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[1].self_attn.k_proj, ProjectionSlice)


def test_member_path_names_the_member():
    assert member_path(f"model.layers.3.self_attn.k_proj.{FUSED_ATTR}") == "model.layers.3.self_attn.k_proj"
    assert member_path("model.layers.3.self_attn.o_proj") == "model.layers.3.self_attn.o_proj"


def _exported(model):
    """The exporter's graph of ``model`` (attention through ExecuTorch's LLM ops)."""
    from export.executorch.llm import ExecuTorchDecoder, plan_layers

    dec = ExecuTorchDecoder(model, plan_layers(model.config, 32))
    seq = torch.export.Dim("seq_len", min=1, max=32)
    with torch.no_grad():
        return torch.export.export(dec, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                   dynamic_shapes=({1: seq}, {0: seq}), strict=True)


def _linears(ep) -> int:
    return sum(n.op == "call_function" and n.target is torch.ops.aten.linear.default for n in ep.graph.nodes)


@pytest.mark.parametrize("quantized", [False, True])
def test_exported_graph_has_one_linear_per_group(quantized):
    """Members trace the shared Linear each; merging leaves one per group, with one dynamic
    quantization of its input; the unfused graph has nothing to merge."""
    from export.executorch.quant import exported_linear_schemes

    layers = BASE["num_hidden_layers"]
    plain = _model("llama")
    if quantized:
        _quantize(plain)
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    ep_plain, ep_fused = _exported(plain), _exported(fused)
    assert merge_duplicate_linears(ep_plain) == 0
    # every member is still named by its own module path (the exporter's scheme check reads them)
    assert exported_linear_schemes(ep_fused) == exported_linear_schemes(ep_plain)
    before = _linears(ep_fused)
    assert merge_duplicate_linears(ep_fused) == 3 * layers  # q/k/v -> 1 (2 gone), gate/up -> 1 (1 gone)
    assert _linears(ep_fused) == before - 3 * layers == _linears(ep_plain) - 3 * layers
    if quantized:
        quant = [n for n in ep_fused.graph.nodes if "choose_qparams_affine" in str(n.target)]
        plain_quant = [n for n in ep_plain.graph.nodes if "choose_qparams_affine" in str(n.target)]
        assert len(quant) == len(plain_quant) - 3 * layers
        assert all(len(n.users) == 1 or all("getitem" in str(u.target) for u in n.users) for n in quant)


@pytest.mark.slow
@pytest.mark.minutes(1.1)
def test_pte_matches_the_unfused_program(lower_variants):
    """The fused 8da4w program gives the unfused program's logits, with 3 fewer linears a layer
    and no more delegate calls or portable kernels."""
    from export.verify import logits_parity

    # biases on q/k/v; one block (lowered twice): the fusion is per block, the counts scale with the blocks
    model = _model("qwen2", num_hidden_layers=1)
    runners, details = lower_variants(model, "fuse_projections", max_seq_len=32, quantize="8da4w", group_size=32)
    ids = torch.randint(3, 256, (32,), generator=torch.Generator().manual_seed(2))
    parity = logits_parity(runners[False], runners[True], [ids[:1], ids[:9], ids])
    assert parity["max_abs_diff"] < 1e-5 and parity["top1_agreement"] == 1.0, parity
    layers = 1
    on, off = details[True], details[False]
    assert on["llm_ops"]["fused_projections"]["fused"] == {"q_proj+k_proj+v_proj": layers, "gate_proj+up_proj": layers}
    assert on["llm_ops"]["merged_linears"] == 3 * layers and off["llm_ops"]["merged_linears"] == 0
    assert off["llm_ops"]["fused_projections"] is None
    assert on["quantization"]["exported_linear"] == off["quantization"]["exported_linear"]
    assert on["delegation"]["delegate_calls"] == off["delegation"]["delegate_calls"]
    assert on["delegation"]["portable_ops"] == off["delegation"]["portable_ops"]
