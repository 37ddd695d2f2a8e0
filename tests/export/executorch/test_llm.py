"""ExecuTorch's LLM custom ops in the exported program, across architecture families.

Each family's tiny random model is lowered once (module fixture, ~20-30 s each) and its .pte
is checked against eager transformers: fp32 logits over several prefill chunks within 1e-4,
greedy generation across chunk boundaries up to the last cache position, and, for
sliding-window models (Mistral-style all-sliding, Gemma-3-style hybrid), generation far past
the window. The graph tests need only ``torch.export`` (seconds).
"""

from __future__ import annotations

import copy

import pytest
import torch

from export.base import ExportError
from export.executorch.exporter import ExecuTorchExporter, ExecuTorchOptions, lower_to_pte
from export.executorch.runner import ExecuTorchRunner
from export.decoding.runtime import EagerRunner, RunnerError, greedy_generate
from export.verify import logits_parity

pytestmark = pytest.mark.timeout(1800)

VOCAB = 512
MAX_SEQ_LEN = 40
WINDOW = 8
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
#: family -> (model_type, config overrides); every family shares BASE's shapes (GQA 4:2)
FAMILIES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),  # q/k RMSNorm over head_dim: the 4-D norm swap
    "mistral-sliding": ("mistral", {"sliding_window": WINDOW}),  # every layer a ring buffer
    # (1 + w) norms, tanh GELU, local + global layers; a small init keeps its greedy output varied
    "gemma3-hybrid": ("gemma3_text", {"head_dim": 16, "sliding_window": WINDOW, "initializer_range": 0.02,
                                      "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {}),  # fused qkv_proj
    "phi3-partial-rope": ("phi3", {"partial_rotary_factor": 0.5}),  # RoPE on half of each head
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2}),  # layer 1 without RoPE (NoPE)
    # attention logit soft-capping (no custom_sdpa: plain ops over the same cache), local + global
    "gemma2-softcap": ("gemma2", {"head_dim": 16, "sliding_window": WINDOW, "initializer_range": 0.02}),
    # a mixture of experts (4 experts, top-2), exported in the dense form of targets/moe.py
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


class _Tok:
    bos_token_id, eos_token_id, vocab_file = 1, 2, ""


def _model(family: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, over = FAMILIES[family]
    cfg = AutoConfig.for_model(model_type, **{**BASE, **over, **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """(family, logits) -> (eager model, .pte path, details), lowered on first use."""
    root = tmp_path_factory.mktemp("llm")
    cache: dict = {}

    def get(family: str, logits: str = "last"):
        key = (family, logits)
        if key not in cache:
            model = _model(family)
            # hand qwen2 over in bfloat16: the exporter's dtype (float32) must really apply
            given = copy.deepcopy(model).to(torch.bfloat16) if family == "qwen2" else model
            if family == "qwen2":
                model = copy.deepcopy(given).float()
            opts = ExecuTorchOptions(max_seq_len=MAX_SEQ_LEN, logits=logits)
            data, details = lower_to_pte(given, _Tok(), opts, log=lambda *_: None)
            path = root / f"{family}-{logits}.pte"
            path.write_bytes(data)
            cache[key] = (model, path, details)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, VOCAB, (MAX_SEQ_LEN,), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_eager(lowered, ids, family):
    """fp32 logits within 1e-4 of eager transformers, from one token to the whole cache, fed
    in the program's prefill chunks (the window for sliding models)."""
    model, path, details = lowered(family)
    runner = ExecuTorchRunner(path)
    sliding = family in ("mistral-sliding", "gemma3-hybrid", "gemma2-softcap")
    assert runner.max_chunk == (WINDOW if sliding else MAX_SEQ_LEN), runner.describe()
    assert details["llm_ops"]["ring_layers"] == {"mistral-sliding": 2, "gemma3-hybrid": 1, "gemma2-softcap": 1}.get(family, 0)
    assert details["llm_ops"]["softcapped_attention_layers"] == (2 if family == "gemma2-softcap" else 0)
    parity = logits_parity(EagerRunner(model), runner, [ids[:1], ids[:13], ids])
    assert parity["max_abs_diff"] < 1e-4 and parity["top1_agreement"] == 1.0, parity
    # q/k/v and gate/up ran as one GEMM each (Phi-3's checkpoint has them fused already), and each
    # layer's ops stayed in one XNNPACK call: fused-projection splits and Phi-3's chunk are slices there
    layers = BASE["num_hidden_layers"]
    experts = 4 if family == "mixtral" else 1  # Mixtral: gate/up fused per expert
    assert details["llm_ops"]["dense_experts"] == (layers if family == "mixtral" else 0)
    fused = details["llm_ops"]["fused_projections"]
    assert fused["fused"] == ({"q_proj+k_proj+v_proj": 0, "gate_proj+up_proj": 0} if family.startswith("phi3") else
                              {"q_proj+k_proj+v_proj": layers, "gate_proj+up_proj": layers * experts}), fused
    if family == "mixtral":  # the dense experts' sums are hidden-width adds that the residual split counts too
        return
    assert details["llm_ops"]["merged_linears"] == (0 if family.startswith("phi3") else 3 * layers)
    # each layer in three XNNPACK calls, split at its two residual adds (export/executorch/xnnpack_boundaries.py)
    assert details["llm_ops"]["residual_boundaries"] == 2 * layers, details["llm_ops"]
    # q, k, v stayed [B, T, H, D] around RoPE (export/executorch/head_layout.py); soft-capped q needs [B, H, T, D]
    assert details["llm_ops"]["head_transposes_removed"] == (4 if family == "gemma2-softcap" else 6) * layers
    # q and k rotated as one tensor where they are adjacent columns rotated alike (export/executorch/joint_rope.py)
    joint = {"qwen2": layers, "mistral-sliding": layers, "phi3": layers, "smollm3": 1}.get(family, 0)
    assert details["llm_ops"]["joint_rope_layers"] == joint, details["llm_ops"]
    if family != "gemma2-softcap":  # its soft-capped attention runs in plain ops, partly outside XNNPACK
        assert details["delegation"]["delegate_calls"] <= 3 * layers + 3, details["delegation"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "mistral-sliding", "gemma3-hybrid", "gemma2-softcap"])
def test_greedy_to_the_end_of_the_cache(lowered, ids, family):
    """Greedy decoding from a prompt that spans several prefill chunks runs to the last cache
    position with eager's tokens (for sliding models, three windows past the first); one more
    position is a clear error, not a wrong token."""
    model, path, _ = lowered(family)
    runner = ExecuTorchRunner(path)
    prompt = ids[:19]  # 3 chunks of 8 for the sliding models
    new = greedy_generate(runner, prompt, MAX_SEQ_LEN)
    ref = greedy_generate(EagerRunner(model, max_seq_len=MAX_SEQ_LEN), prompt, MAX_SEQ_LEN)
    assert len(new) == MAX_SEQ_LEN - len(prompt) + 1 and runner.position == MAX_SEQ_LEN
    assert len(set(new)) > 3, "greedy output should vary (a constant output hides cache bugs)"
    assert new == ref
    with pytest.raises(RunnerError, match="max_seq_len"):
        runner.forward(torch.tensor([new[-1]]))


@pytest.mark.slow
@pytest.mark.parametrize("logits", ["last", "all"])
def test_whole_cache_in_one_prefill(lowered, ids, logits):
    """A full-attention program takes max_seq_len tokens in one call (not max_seq_len - 1) and
    returns the last position's logits (``logits: last``, the default) or every position's."""
    model, path, details = lowered("qwen2", logits)  # the programs test_all_position_logits_in_chunks also reads
    runner = ExecuTorchRunner(path)
    assert details["metadata"]["get_max_prefill_chunk"] == MAX_SEQ_LEN == runner.max_chunk
    assert details["llm_ops"]["logits"] == logits and runner.all_positions == (logits == "all")
    out = runner.forward(ids, all_logits=False)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    assert runner.position == MAX_SEQ_LEN and out.shape == (1, VOCAB)
    assert (out - ref[-1:]).abs().max() < 1e-4
    if logits == "all":  # one call gave every position
        runner.reset()
        assert (runner.forward(ids) - ref).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gemma3-hybrid"])
def test_all_position_logits_in_chunks(lowered, ids, family):
    """``logits: all`` returns every fed position per call; fed in prefill chunks they match eager."""
    model, path, _ = lowered(family, "all")
    runner = ExecuTorchRunner(path)
    assert runner.all_positions
    parity = logits_parity(EagerRunner(model), runner, [ids[:13], ids])
    assert parity["max_abs_diff"] < 1e-4 and parity["top1_agreement"] == 1.0, parity


def _program_ops(path) -> list[str]:
    """Operator names of every instruction of the program's forward plan (read from the file)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(path.read_bytes())
    program = getattr(program, "program", program)
    plan = next(p for p in program.execution_plan if p.name == "forward")
    names = [op.name for op in plan.operators]
    out = []
    for chain in plan.chains:
        for ins in chain.instructions:
            args = ins.instr_args
            if hasattr(args, "op_index"):
                out.append(names[args.op_index])
            elif hasattr(args, "delegate_index"):
                out.append("<delegate:" + plan.delegates[args.delegate_index].id + ">")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "mistral-sliding"])
def test_program_runs_the_custom_ops(lowered, family):
    """Read from the .pte itself: one llama::custom_sdpa and two cache updates per layer (with
    indices for ring layers), XNNPACK delegates, and no KV index_put or GQA expand left."""
    _, path, _ = lowered(family)
    ops = _program_ops(path)
    layers = BASE["num_hidden_layers"]
    update = "llama::update_cache_with_indices" if family == "mistral-sliding" else "llama::update_cache"
    assert ops.count("llama::custom_sdpa") == layers, sorted(set(ops))
    assert ops.count(update) == 2 * layers, sorted(set(ops))
    assert any(o.startswith("<delegate:XnnpackBackend") for o in ops)
    assert not [o for o in ops if o in ("aten::expand_copy", "aten::mean")], sorted(set(ops))
    # the only index_put left writes a ring's slot positions, once per call
    assert ops.count("aten::index_put") == (1 if family == "mistral-sliding" else 0), sorted(set(ops))
    # RoPE's rotate_half and the head reshapes run inside XNNPACK: between a layer's three delegates
    # only the cache updates, custom_sdpa, a free view and the two residual adds (the boundaries of
    # export/executorch/xnnpack_boundaries.py); the one slice picks the last position
    portable = [o for o in ops if not o.startswith("<delegate")]
    assert "aten::unsqueeze_copy" not in portable and "aten::view_copy" not in portable, portable
    assert portable.count("aten::slice_copy") == 1, portable
    assert portable.count("aten::add") == 2 * layers + (2 if family == "mistral-sliding" else 0), portable  # + ring index adds
    # what runs once per call stays small (a ring's slot indices and window mask: ~30 ops)
    assert len(ops) - 9 * layers < (40 if family == "mistral-sliding" else 16), ops


def _graph_ops(family: str, layers: int) -> dict[str, int]:
    from collections import Counter

    from export.executorch.delegable import swap_rms_norms
    from export.executorch.llm import ExecuTorchDecoder, plan_layers

    over = {"num_hidden_layers": layers}
    if family == "gemma3-hybrid":
        over["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    model = _model(family, **over)
    swap_rms_norms(model)
    dec = ExecuTorchDecoder(model, plan_layers(model.config, MAX_SEQ_LEN))
    seq = torch.export.Dim("seq_len", min=1, max=WINDOW)
    with torch.no_grad():
        ep = torch.export.export(dec, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                 dynamic_shapes=({1: seq}, {0: seq}), strict=True)
    return dict(Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "mistral-sliding", "gemma3-hybrid"])
def test_masks_are_built_once_per_call(family):
    """Doubling the layers doubles the attention ops but not the mask/position ops: the
    causal mask is the custom op's own, and a ring's indices and window mask are computed once
    per call for all sliding layers."""
    two, four = _graph_ops(family, 2), _graph_ops(family, 4)
    assert four["llama.custom_sdpa.default"] == 2 * two["llama.custom_sdpa.default"] == 4
    mask_ops = tuple(f"aten.{op}." for op in ("where", "arange", "logical_not", "bitwise_and", "ge", "lt", "le",
                                              "remainder", "index_put", "index_put_", "full", "eq"))
    for op, n in four.items():
        if op.startswith(mask_ops):
            assert n == two.get(op), (op, two.get(op), n)
    if family == "qwen3":  # full attention: no mask at all
        assert not [op for op in four if op.startswith(mask_ops)], four


# ---- refusals at validation time (config only, no weights) ------------------------------------


def _config(model_type: str, **over):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**BASE, **over})


@pytest.mark.parametrize(
    "model_type, over, opts, message",
    [
        ("bloom", {}, {}, "model type 'bloom' uses ALiBi attention"),  # llama::custom_sdpa adds no bias
        ("llama", {}, {"max_seq_len": 512}, "max_seq_len=512 exceeds the model's max_position_embeddings=256"),
        ("llama", {}, {"quantize": "8da4w", "group_size": 96}, "group_size=96 does not divide the in_features"),
        ("llama", {}, {"quantize": "8da4w", "group_size": 40}, "group_size=40 is not a multiple of 32"),
        ("llama", {}, {"embedding_quantize": "int4", "embedding_group_size": 48},
         "embedding_group_size=48 does not divide the embedding width 64"),
        ("mistral", {"sliding_window": 0}, {}, "sliding_window=0 must be positive"),
    ],
)
def test_check_model_refuses(model_type, over, opts, message):
    problems = ExecuTorchExporter().check_model(_config(model_type, **over), ExecuTorchOptions(**opts))
    assert any(message in p for p in problems), problems



@pytest.mark.parametrize("family", list(FAMILIES))
def test_check_model_accepts_the_families(family):
    model_type, over = FAMILIES[family]
    assert ExecuTorchExporter().check_model(_config(model_type, **over), ExecuTorchOptions(max_seq_len=64)) == []


def test_validate_refuses_before_any_stage(tmp_path):
    """`optimize validate` runs the exporter's check on the model's config: a BLOOM (ALiBi)
    pipeline targeting ExecuTorch is refused with the reason, before weights are loaded."""
    from optimize.config import load_config
    from optimize.config_checks import model_problems

    cfg = load_config({"version": 1, "name": "t", "model": {"source": "random", "config": {
        "model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 49152}},
        "target": "executorch", "stages": []}, check_model=False)
    problems = model_problems(cfg)
    assert any(where == "target" and "model type 'bloom' uses ALiBi" in msg for where, msg in problems), problems


def test_profile_max_seq_len_reaches_the_exporter(tmp_path):
    """A custom profile's max_seq_len is the exporter's default; the YAML's export block wins."""
    import yaml

    from optimize.config import load_config
    from optimize.config_checks import export_options
    from targets import load_target
    from targets.profile import PROFILE_DIR

    prof = yaml.safe_load((PROFILE_DIR / "executorch.yaml").read_text())
    prof.update(name="my-phone", max_seq_len=96)
    path = tmp_path / "my-phone.yaml"
    path.write_text(yaml.safe_dump(prof))
    profile = load_target(path)
    base = {"version": 1, "name": "t", "model": {"source": "random", "config": dict(BASE, model_type="llama",
                                                                                     vocab_size=49152)},
            "target": str(path), "stages": []}
    assert export_options(load_config(base, check_model=False), "executorch", profile).max_seq_len == 96
    base["export"] = {"executorch": {"max_seq_len": 64}}
    assert export_options(load_config(base, check_model=False), "executorch", profile).max_seq_len == 64


def test_unsupported_attention_is_refused_at_export():
    """An exporter call that skips validation still refuses, with the same sentence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config("bloom", n_layer=1, n_head=4)).eval()
    with pytest.raises(ExportError, match="model type 'bloom' uses ALiBi"):
        lower_to_pte(model, _Tok(), ExecuTorchOptions(max_seq_len=16), log=lambda *_: None)
