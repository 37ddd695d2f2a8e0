"""ONNX Runtime's fused graph (onnxruntime-genai's model builder + the stages' integers):
every supported family against eager, sliding windows past the window, onnxruntime-genai
packaging, exactness of carried-over 4-bit/8-bit quantization, refusals at validation time."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from pydantic import ValidationError

from export.base import ExportError, exporter_for_artifact
from export.onnxruntime.exporter import FUSED_MODEL_TYPES, OnnxRuntimeExporter, OnnxRuntimeOptions
from export.decoding.runtime import EagerRunner, greedy_generate
from export.verify import greedy_match, logits_parity

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, max_position_embeddings=1024, initializer_range=0.2)
WINDOW = 8
# One tiny config per supported family; sliding windows of 8 tokens, so 40-token checks run past them.
FAMILIES = {
    "llama": dict(tie_word_embeddings=True),
    "mistral": dict(sliding_window=WINDOW, tie_word_embeddings=False),  # every layer slides
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
    "qwen3": dict(head_dim=16, tie_word_embeddings=True),  # q_norm / k_norm
    # fused qkv_proj / gate_up_proj; original_max_position_embeddings (4096) != max: plain RoPE still
    "phi3": dict(tie_word_embeddings=False, pad_token_id=0, sliding_window=WINDOW),
    "gemma": dict(head_dim=16, tie_word_embeddings=True),  # (1 + weight) RMSNorm, scaled embedding
    "gemma2": dict(head_dim=16, sliding_window=WINDOW, tie_word_embeddings=True),  # alternating local/global, softcaps
    "gemma3_text": dict(head_dim=16, sliding_window=WINDOW, tie_word_embeddings=True, num_hidden_layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}
TINY_LLAMA = dict(model_type="llama", **BASE, tie_word_embeddings=True, rope_theta=100000.0)
IDS = torch.arange(1, 41) * 37 % 4000  # 40 tokens: five windows


def _quiet(*_a, **_k):
    pass


def _family_model(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(name, **{**BASE, **FAMILIES[name]})
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_every_family_is_listed():
    assert set(FAMILIES) == set(FUSED_MODEL_TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_eager_past_the_window(family, smollm2_tokenizer, tmp_path):
    """fp32 logits within 1e-4 of eager over 40 tokens (five sliding windows), prefill then
    decode, in a plain InferenceSession; greedy tokens equal eager's through onnxruntime-genai
    (our loop over its Generator, and its own greedy search)."""
    model = _family_model(family)
    ex = OnnxRuntimeExporter()
    assert ex.check_model(model.config, {}) == []
    res = ex.export(model, smollm2_tokenizer, tmp_path, {}, log=_quiet)
    ops = res.manifest["ops"]
    assert ops.get("GroupQueryAttention") == model.config.num_hidden_layers and "SkipSimplifiedLayerNormalization" in ops
    runner = ex.load(res.artifact)
    assert logits_parity(EagerRunner(model), runner, [IDS])["max_abs_diff"] < 1e-4
    eager = EagerRunner(model)
    runner.reset()
    for chunk in (IDS[:20], IDS[20:21], IDS[21:30], IDS[30:31]):  # prefill, decode, a chunk, decode
        assert (runner.forward(chunk) - eager.forward(chunk)).abs().max() < 1e-4
    genai = ex.load(res.extra_artifacts["genai"])
    assert genai.runtime == "onnxruntime-genai"
    gm = greedy_match(EagerRunner(model), genai, IDS[:6], 24)  # 30 positions: past the window
    assert gm["match"], gm
    assert res.manifest["smoke_check"]["genai_greedy"]["match"]
    for r in (runner, genai):  # shared-context scoring: cut back to the context, continue = a fresh run
        r.reset()
        r.forward(IDS[:10], all_logits=False)
        r.forward(IDS[10:22])  # past the sliding windows: the cut must restore what they dropped
        assert r.truncate(10) and r.position == 10, (family, r.runtime)
        cut = r.forward(IDS[22:30])
        r.reset()
        r.forward(IDS[:10], all_logits=False)
        assert (cut - r.forward(IDS[22:30])).abs().max() < 1e-5, (family, r.runtime)
    # GroupQueryAttention refuses a batch above 1 with a past: the choices go one at a time here
    assert runner.forward_each([IDS[10:22], IDS[22:30]]) is None
    assert genai.forward_each([IDS[10:22], IDS[22:30]]) is None


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text"])
def test_prefill_in_chunks_gives_the_one_call_logits(family, smollm2_tokenizer, tmp_path):
    """``prefill_chunk``: a 40-token prompt goes in calls of 7 tokens through ONNX Runtime and through
    onnxruntime-genai (our appends, and genai's own Generator from ``search.chunk_size``), past the
    sliding windows: every position's logits within 1e-4 of eager, and genai's own greedy search
    equal to eager's."""
    model = _family_model(family)
    ex = OnnxRuntimeExporter()
    res = ex.export(model, smollm2_tokenizer, tmp_path, {"prefill_chunk": 7}, log=_quiet)
    assert res.manifest["prefill_chunk"] == 7
    assert json.loads((tmp_path / "genai_config.json").read_text())["search"]["chunk_size"] == 7
    want = EagerRunner(model).forward(IDS)
    for r in (ex.load(res.artifact), ex.load(res.extra_artifacts["genai"])):
        assert r.prefill_chunk == 7
        r.reset()
        got = r.forward(IDS)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4, r.runtime
        r.reset()
        last = r.forward(IDS, all_logits=False)
        assert last.shape[0] == 1 and (last[0] - want[-1]).abs().max() < 1e-4, r.runtime
        # the last row is a copy: a view kept every call's positions x vocab logits alive, which made a
        # full-context prefill's peak grow by the vocabulary's bytes per position (1.6 GB for SmolLM2)
        assert last.untyped_storage().nbytes() == last.numel() * 4, r.runtime
    from export.onnxruntime.genai_runner import genai_greedy

    assert genai_greedy(tmp_path, IDS[:20].tolist(), 10) == greedy_generate(EagerRunner(model), IDS[:20], 10)


# ---------------------------------------------------------------- quantization carried over


def _ptq(cfg: dict, calibration=()):
    from optimize.stage_api import StageContext
    from optimize.stages.ptq_int8 import Ptq8Config, ptq_int8
    from targets.sources import RandomSource, load_model

    lm = load_model(RandomSource(config=dict(TINY_LLAMA), seed=0))
    ctx = StageContext(tokenizer=lm.tokenizer, calibration=list(calibration), train_ids=None, target=None,
                       work_dir=Path("."), log=_quiet)
    return ptq_int8(lm.model, Ptq8Config(**cfg), ctx), lm.tokenizer


def _weight_only(model: torch.nn.Module) -> torch.nn.Module:
    """The eager model with each quantized weight dequantized and activations left fp32."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and type(m.weight) not in (torch.Tensor, torch.nn.Parameter):
            m.weight = torch.nn.Parameter(m.weight.dequantize(), requires_grad=False)
    return ref


def _unpack_nbits(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed.astype(np.int32) - 128
    lo, hi = packed & 0x0F, packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.int32) - 8


@pytest.fixture(scope="module")
def gptq_int4(smollm2_tokenizer):
    """8da4w g32 with GPTQ's integers (not round-to-nearest), lm_head int8, embedding tied to it."""
    calib = [torch.arange(i, i + 64) * 13 % 4000 for i in range(4)]
    return _ptq(dict(scheme="8da4w", group_size=32, algorithm="gptq", keep_high_precision=[], int8_modules=["lm_head"],
                     quantize_embedding="tied"), calib)


def test_gptq_integers_reach_the_graph_exactly(gptq_int4, tmp_path):
    """Every MatMulNBits holds the stage's integers and scales bit for bit; with fp32 activations
    (accuracy_level 1) the logits equal the eager model with those weights to 1e-4."""
    model, tok = gptq_int4
    res = OnnxRuntimeExporter().export(model, tok, tmp_path, {"accuracy_level": 1}, log=_quiet)
    proto = onnx.load(str(res.artifact))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    nodes = {n.name: n for n in proto.graph.node}
    assert "MatMul" not in res.manifest["ops"] and res.manifest["ops"]["MatMulNBits"] == 2 * 5 + 1  # qkv o gate up down, head
    layer = model.model.layers[1]
    for node_name, parts in {"/model/layers.1/attn/qkv_proj/MatMulNBits": ["q_proj", "k_proj", "v_proj"],
                             "/model/layers.1/mlp/down_proj/MatMulNBits": ["down_proj"], "/lm_head/MatMulNBits": None}.items():
        node = nodes[node_name]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        weights = [model.lm_head.weight] if parts is None else [
            getattr(layer.self_attn if p.endswith(("q_proj", "k_proj", "v_proj")) else layer.mlp, p).weight for p in parts]
        q = torch.cat([w.qdata for w in weights]).numpy().astype(np.int32)
        scale = torch.cat([w.scale for w in weights])
        got_q = _unpack_nbits(inits[node.input[1]], attrs["bits"]).reshape(q.shape)
        np.testing.assert_array_equal(got_q, q)
        reps = inits[node.input[2]].shape[1] // scale.shape[1]  # a per-channel scale repeats per block
        np.testing.assert_array_equal(inits[node.input[2]], scale.repeat_interleave(reps, dim=1).numpy())
    runner = OnnxRuntimeExporter().load(res.artifact)
    assert logits_parity(EagerRunner(_weight_only(model)), runner, [IDS])["max_abs_diff"] < 1e-4


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_hqq_scales_reach_the_graph_exactly(tmp_path):
    """HQQ-optimised scales (scale only, symmetric): the same integers x scales in ORT as in
    eager, logits within 1e-4 at fp32 activations (accuracy_level 1)."""
    model, tok = _ptq(dict(scheme="8da4w", group_size=32, weight_qparams="hqq_scale_only"))
    res = OnnxRuntimeExporter().export(model, tok, tmp_path, {"accuracy_level": 1}, log=_quiet)
    assert res.manifest["ops"]["MatMulNBits"] == 2 * 5
    par = logits_parity(EagerRunner(_weight_only(model)), OnnxRuntimeExporter().load(res.artifact), [IDS])
    assert par["max_abs_diff"] < 1e-4, par


def test_tied_embedding_shares_the_lm_head_bytes(gptq_int4, tmp_path):
    """quantize_embedding: tied -> one packed table read by MatMulNBits (lm_head) and by
    GatherBlockQuantized (the embedding); no fp32 table ships."""
    model, tok = gptq_int4
    res = OnnxRuntimeExporter().export(model, tok, tmp_path, {}, log=_quiet)  # a tied int8 head takes MatMulNBits
    proto = onnx.load(str(res.artifact), load_external_data=False)
    gbq = next(n for n in proto.graph.node if n.op_type == "GatherBlockQuantized")
    reshape = next(n for n in proto.graph.node if n.output[0] == gbq.input[0])
    head = next(n for n in proto.graph.node if n.name == "/lm_head/MatMulNBits")
    assert reshape.input[0] == head.input[1] and gbq.input[2] == head.input[2]
    assert res.manifest["quantization"]["embedding"].startswith("int8 shared with lm_head")
    assert not any(t.name in ("lm_head.MatMul.weight", "model.embed_tokens.weight") for t in proto.graph.initializer)
    assert res.manifest["size_bytes"] < 0.35 * 4 * sum(p.numel() for p in _weight_only(model).parameters())


def test_int4_with_int8_activations_tracks_the_fake_quant_model(smollm2_tokenizer, tmp_path):
    """accuracy_level 4 (int8 activations per block, ORT's kernel) against eager 8da4w (int8
    activations per token): the two differ only in how activations round, so the ORT model sits
    far closer to the eager fake-quant model than the fp32 model does (stated bound: 0.5x)."""
    from targets.sources import RandomSource, load_model

    model, tok = _ptq(dict(scheme="8da4w", group_size=32))
    fp32 = load_model(RandomSource(config=dict(TINY_LLAMA), seed=0)).model
    res = OnnxRuntimeExporter().export(model, tok, tmp_path, {}, log=_quiet)
    runner = OnnxRuntimeExporter().load(res.artifact)
    runner.reset()
    got = runner.forward(IDS)
    with torch.no_grad():
        fq, ref = model(IDS.view(1, -1)).logits[0], fp32(IDS.view(1, -1)).logits[0]
    err, drift = float((got - fq).abs().mean()), float((ref - fq).abs().mean())
    assert err < 0.5 * drift, (err, drift)
    assert (got.argmax(-1) == fq.argmax(-1)).float().mean() >= 0.8  # a random model's logits are near-ties


def test_8da8w_runs_the_eager_arithmetic(smollm2_tokenizer, tmp_path, monkeypatch):
    """8da8w -> per-token MatMulInteger: the same integers and activation grid as eager's torchao
    8da8w, so logits agree to float rounding (and the odd rounding tie). The scratch space holds
    two fp32 copies of the model at most: the builder's Hugging Face input is gone by the install."""
    from export.onnxruntime import fused_export

    real_install, scratch = fused_export.install, []

    def install(built, out, *args, **kwargs):
        scratch.append(sorted(p.name for p in Path(built).parent.parent.iterdir()))  # work/built/model.onnx
        return real_install(built, out, *args, **kwargs)

    monkeypatch.setattr(fused_export, "install", install)
    model, tok = _ptq(dict(scheme="8da8w"))
    res = OnnxRuntimeExporter().export(model, tok, tmp_path, {}, log=_quiet)
    assert scratch == [["built"]], scratch
    assert res.manifest["ops"]["MatMulInteger"] == 2 * 5 and "MatMulNBits" not in res.manifest["ops"]
    runner = OnnxRuntimeExporter().load(res.artifact)
    par = logits_parity(EagerRunner(model), runner, [IDS])
    assert par["max_abs_diff"] < 0.1 and par["top1_agreement"] == 1.0, par


@pytest.mark.slow
def test_decode_branch_is_the_per_token_arithmetic(tmp_path):
    """decode_branch: one-token calls run each int8 Linear as one DynamicQuantizeMatMul, which
    for one token is the per-token chain's arithmetic: decode logits equal the chain graph's."""
    model, tok = _ptq(dict(scheme="8da8w"))
    ex = OnnxRuntimeExporter()
    branch = ex.export(model, tok, tmp_path / "b", {}, log=_quiet)
    chain = ex.export(model, tok, tmp_path / "c", {"decode_branch": False}, log=_quiet)
    assert branch.manifest["decode_ops"]["DynamicQuantizeMatMul"] == 2 * 5
    assert "MatMulInteger" not in branch.manifest["decode_ops"] and branch.manifest["ops"]["MatMulInteger"] == 2 * 5
    assert "decode_ops" not in chain.manifest
    a, b = ex.load(branch.artifact), ex.load(chain.artifact)
    a.reset(), b.reset()
    assert (a.forward(IDS[:12]) - b.forward(IDS[:12])).abs().max() < 1e-5  # prefill: the same chain
    for t in IDS[12:20]:
        assert (a.forward(t.view(1)) - b.forward(t.view(1))).abs().max() < 1e-4
    assert greedy_generate(ex.load(branch.extra_artifacts["genai"]), IDS[:6], 8) == greedy_generate(b, IDS[:6], 8)


def test_exporter_w8a8_per_token_on_the_fused_graph(tmp_path):
    """quantize: dynamic_per_token on an fp32 model: every weight int8 per channel behind
    per-token activations, lm_head included, the embedding int8 per row (GatherBlockQuantized)."""
    from targets.sources import RandomSource, load_model

    lm = load_model(RandomSource(config=dict(TINY_LLAMA), seed=0))
    opts = {"quantize": "dynamic_per_token", "quantize_lm_head": True, "quantize_embedding": True}
    res = OnnxRuntimeExporter().export(lm.model, lm.tokenizer, tmp_path, opts, log=_quiet)
    ops = res.manifest["ops"]
    assert ops["MatMulInteger"] == 2 * 5 + 1 and ops["GatherBlockQuantized"] == 1 and "MatMul" not in ops
    runner = OnnxRuntimeExporter().load(res.artifact)
    # the tiny model is mostly its 49152x64 tables: lm_head and embedding become two int8 copies
    assert runner.size_bytes() < 0.6 * 4 * sum(p.numel() for p in lm.model.parameters())
    par = logits_parity(EagerRunner(lm.model), runner, [IDS])
    assert par["top1_agreement"] >= 0.85, par


@pytest.mark.slow
def test_awq_gptq_pipeline_to_onnxruntime_reports_both_runtimes(tmp_path):
    """AWQ -> ptq_int8 (GPTQ, 8da4w, lm_head int8 tied to the embedding) -> --target onnxruntime:
    the profile takes the eager-quantized model, and the report has a row measured in a plain
    InferenceSession and one in onnxruntime-genai, each with perplexity and greedy agreement."""
    from optimize.pipeline import run_pipeline

    cfg = {"version": 1, "name": "tiny-ort-int4", "model": {"source": "random", "config": dict(TINY_LLAMA)},
           "data": {"eval_tokens": 256, "calibration_tokens": 256, "seq_len": 128}, "target": "onnxruntime",
           "checks": {"latency": {"runs": 1, "warmup": 0, "decode_tokens": 4, "prompt_tokens": 16, "threads": 1},
                      "generate_tokens": 8, "memory": False},  # the peak-RSS children: tests/optimize/test_memory.py
           "stages": [{"kind": "awq", "scheme": "8da4w", "keep_high_precision": [], "calibration_windows": 1},
                      {"kind": "ptq_int8", "scheme": "8da4w", "algorithm": "gptq", "keep_high_precision": [],
                       "int8_modules": ["lm_head"], "quantize_embedding": "tied"}],
           "output_dir": str(tmp_path / "run")}
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(cfg))
    report = run_pipeline(path, say=_quiet)
    assert report.ok, [(r.name, r.status, r.error) for r in report.rows]
    plain, genai = report.row("export:onnxruntime"), report.row("export:onnxruntime:genai")
    assert plain.runtime == "onnxruntime" and genai.runtime == "onnxruntime-genai"
    assert plain.details["quantization"]["embedding"].startswith("int8 shared with lm_head")
    assert abs(plain.metrics.perplexity - genai.metrics.perplexity) < 1e-3 * plain.metrics.perplexity
    assert plain.details["greedy"]["runtime_text"] == genai.details["greedy"]["runtime_text"]
    assert plain.details["genai_greedy"]["tokens"] == 8


# ---------------------------------------------------------------- packaging and run


def test_optimize_run_on_the_export_directory(smollm2_tokenizer, tmp_path, capsys):
    """`optimize run <dir>` drives onnxruntime-genai and streams eager's greedy text."""
    from optimize.cli import main
    from targets.sources import RandomSource, load_model

    model = load_model(RandomSource(config=dict(TINY_LLAMA), seed=0)).model
    res = OnnxRuntimeExporter().export(model, smollm2_tokenizer, tmp_path / "onnx", {}, log=_quiet)
    assert exporter_for_artifact(tmp_path / "onnx").name == "onnxruntime"
    prompt = "What is the capital of France?"
    assert main(["run", str(tmp_path / "onnx"), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    streamed = capsys.readouterr().out.strip()
    ids = smollm2_tokenizer(prompt)["input_ids"]
    want = greedy_generate(EagerRunner(model), torch.tensor(ids), 6, eos_token_ids=[smollm2_tokenizer.eos_token_id])
    assert streamed == smollm2_tokenizer.decode(want, skip_special_tokens=True).strip() and streamed
    files = set(res.manifest["files"])
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "config.json"} <= files
    genai = json.loads((tmp_path / "onnx" / "genai_config.json").read_text())
    assert genai["search"]["max_length"] == model.config.max_position_embeddings


@pytest.mark.slow
def test_smollm2_fused_fp32_w8a8_and_int4(smollm2_loaded, pydoc_splits, tmp_path):
    """SmolLM2-135M: the fused fp32 graph answers like eager in both runtimes; per-token W8A8
    (every weight int8) is under 0.35x the fp32 file and within 6% perplexity on a 512-token
    window; RTN int4 with the lm_head tied to the embedding is the builder's layout (~0.17x)
    and still answers."""
    lm = smollm2_loaded
    ex = OnnxRuntimeExporter()
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = torch.as_tensor(prompt).reshape(-1)
    window = [pydoc_splits.eval_ids[:513]]
    from optimize.checks.accuracy import evaluate

    fp32 = ex.export(lm.model, lm.tokenizer, tmp_path / "fp32", {}, log=_quiet)
    assert fp32.manifest["ops"]["GroupQueryAttention"] == 30 and sum(fp32.manifest["ops"].values()) < 500
    r32 = ex.load(fp32.artifact)
    for runner in (r32, ex.load(fp32.extra_artifacts["genai"])):
        res = greedy_match(EagerRunner(lm.model), runner, prompt, 10)
        assert res["match"] and "Paris" in lm.tokenizer.decode(res["test_ids"]), res
    answer = torch.tensor(res["test_ids"])  # "The capital of France is Paris..."
    paris = next(i for i, t in enumerate(answer.tolist()) if "Paris" in lm.tokenizer.decode([t]))
    ppl32 = evaluate(r32, window).perplexity
    size32 = r32.size_bytes()
    # each artifact goes once checked: the fp32 package (model and genai copy) is 1.1 GB of the
    # suite's temporary space, which must stay under 4 GB with the other worker busy
    del r32, runner
    shutil.rmtree(tmp_path / "fp32")

    opts = {"quantize": "dynamic_per_token", "quantize_lm_head": True, "quantize_embedding": True}
    w8 = ex.export(lm.model, lm.tokenizer, tmp_path / "w8a8", opts, log=_quiet)
    r8 = ex.load(w8.artifact)
    assert r8.size_bytes() < 0.35 * size32
    # no SmoothQuant here (every weight RTN int8, lm_head and embedding too): +3.8% on this
    # window; with SmoothQuant (examples/smollm2_onnx.yaml) bench/onnxruntime.py measures the recipe
    assert evaluate(r8, window).perplexity < 1.06 * ppl32
    # fp32's own first answer token is a near-tie ("The" 25.33 against "L" 25.24 in eager), which
    # int8 everywhere may flip (it does on AVX2, u8u8: "L" by 0.05), so greedy text is a coin
    # toss here; led along fp32's answer, W8A8 picks its tokens and names Paris.
    r8.reset()
    led = r8.forward(torch.cat([prompt, answer[:-1]]))[prompt.numel() - 1:].argmax(-1)
    assert led[paris] == answer[paris] and (led == answer).float().mean() >= 0.8, (led.tolist(), answer.tolist())
    del r8
    shutil.rmtree(tmp_path / "w8a8")

    model = copy.deepcopy(lm.model)
    from optimize.stage_api import StageContext
    from optimize.stages.ptq_int8 import Ptq8Config, ptq_int8

    ctx = StageContext(tokenizer=lm.tokenizer, calibration=[], train_ids=None, target=None, work_dir=tmp_path, log=_quiet)
    model = ptq_int8(model, Ptq8Config(scheme="8da4w", keep_high_precision=[], quantize_embedding="tied"), ctx)
    q4 = ex.export(model, lm.tokenizer, tmp_path / "int4", {}, log=_quiet)
    r4 = ex.load(q4.artifact)
    assert r4.size_bytes() < 0.2 * size32 and q4.manifest["ops"].get("GatherBlockQuantized") == 1
    g4 = ex.load(q4.extra_artifacts["genai"])  # led along fp32's answer, as W8A8 above
    led = g4.forward(torch.cat([prompt, answer[:-1]]))[prompt.numel() - 1:].argmax(-1)
    assert led[paris] == answer[paris] and (led == answer).float().mean() >= 0.7, (led.tolist(), answer.tolist())


# ---------------------------------------------------------------- refusals


def _validate(tmp_path: Path, config: dict, **extra):
    from optimize.config import ConfigError, load_config

    cfg = {"version": 1, "name": "t", "model": {"source": "random", "config": config}, "target": "onnxruntime",
           "stages": [{"kind": "ptq_int8", "scheme": "8da4w"}], **extra}
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return str(err.value)


def test_unsupported_model_refused_at_validation_with_the_list(tmp_path):
    msg = _validate(tmp_path, dict(model_type="gptj", vocab_size=128, n_embd=32, n_layer=1, n_head=2, rotary_dim=8))
    assert "model_type 'gptj' is not supported; supported: llama, mistral, qwen2, qwen3, phi3, gemma, gemma2, " \
           "gemma3_text" in msg, msg


def test_unbuildable_rope_refused_at_validation(tmp_path):
    cfg = dict(TINY_LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    msg = _validate(tmp_path, cfg)
    assert "RoPE type 'llama3' is not built by onnxruntime-genai's model builder" in msg, msg


def test_head_size_groupqueryattention_cannot_run_is_refused_at_validation(tmp_path):
    """head_dim 8: ONNX Runtime's GroupQueryAttention fails on it at run time ("head_size shall be a
    multiple of 16"), so validate refuses the fused graph and names the dynamo graph, which runs it."""
    small_heads = dict(TINY_LLAMA, hidden_size=32)  # 4 heads of 8
    msg = _validate(tmp_path, small_heads, stages=[])
    assert "head_dim 8 is not a multiple of 16: ONNX Runtime's GroupQueryAttention refuses it" in msg, msg
    assert "graph: dynamo exports it" in msg, msg
    from transformers import LlamaConfig

    config = LlamaConfig(**{k: v for k, v in small_heads.items() if k != "model_type"})
    assert OnnxRuntimeExporter().check_model(config, {"graph": "dynamo"}) == []
    assert OnnxRuntimeExporter().check_model(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}),
                                             {}) == []


def test_sliding_window_on_the_dynamo_graph_refused(tmp_path):
    msg = _validate(tmp_path, dict(model_type="mistral", **BASE, sliding_window=8),
                    export={"onnxruntime": {"graph": "dynamo"}}, stages=[])
    assert "mistral with sliding-window attention needs the fused graph" in msg, msg


def test_gpt2_takes_the_dynamo_graph_and_not_the_fused_one():
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128)
    ex = OnnxRuntimeExporter()
    assert ex.check_model(cfg, {}) == []
    assert ex.check_model(cfg, {"graph": "fused"}) == [
        f"model_type 'gpt2' has no fused ONNX Runtime graph; supported: {', '.join(FUSED_MODEL_TYPES)}"]


def test_dynamo_node_names_refused_on_the_fused_graph():
    from transformers import LlamaConfig

    problems = OnnxRuntimeExporter().check_model(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}),
                                                 {"quantize": "dynamic_per_token", "nodes_to_exclude": ["node_7"]})
    assert problems == ["nodes_to_exclude names nodes of the dynamo graph; on the fused graph use exclude_modules "
                        "(Hugging Face module patterns, e.g. '*.mlp.down_proj')"]


@pytest.mark.parametrize("opts,needle", [
    ({"opset": 20}, "opset applies only to the dynamo graph, and this export builds the fused one"),
    ({"graph": "fused", "external_data": "never"}, "external_data: never is not possible on the fused graph"),
    ({"graph": "dynamo", "accuracy_level": 1, "decode_branch": False},
     "accuracy_level, decode_branch apply only to the fused graph, and this export builds the dynamo one"),
    ({"graph": "dynamo", "last_logits": False},
     "last_logits applies only to the fused graph, and this export builds the dynamo one"),
])
def test_options_of_the_other_graph_are_refused_not_ignored(opts, needle):
    from transformers import LlamaConfig

    problems = OnnxRuntimeExporter().check_model(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}),
                                                 opts)
    assert any(needle in p for p in problems), problems


def test_quantized_model_on_the_dynamo_graph_is_refused(tmp_path):
    model, tok = _ptq(dict(scheme="8da8w"))
    with pytest.raises(ExportError, match="hold torchao quantized weights .* only the fused graph carries them"):
        OnnxRuntimeExporter().export(model, tok, tmp_path, {"graph": "dynamo"}, log=_quiet)


@pytest.mark.parametrize("opts,needle", [
    ({"graph": "fused", "quantize": "static"}, "quantize: static is ORT's QDQ quantizer, which runs on the dynamo graph"),
    ({"graph": "onnx"}, "'auto', 'fused' or 'dynamo'"),
    ({"accuracy_level": 2}, "Input should be 1 or 4"),
    ({"int8_kernel": "integer"}, "'per_token' or 'nbits'"),
    ({"last_logits": "sometimes"}, "last_logits\n  Input should be a valid boolean"),
    ({"arm64_kleidiai": "fast"}, "arm64_kleidiai\n  Input should be a valid boolean"),
])
def test_bad_fused_options(opts, needle):
    with pytest.raises(ValidationError, match=needle):
        OnnxRuntimeOptions.model_validate(opts)


def test_nbits_layout_round_trips_and_refuses_odd_groups():
    """Packing: unsigned q + 8, low nibble first, a per-channel scale repeated per block; a group
    that no power-of-two block >= 16 tiles is refused by name."""
    from export.onnxruntime.weights import BlockQuant, nbits_arrays

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 64), generator=g, dtype=torch.int8)
    bq = BlockQuant(q, torch.rand(3, 1, generator=g) + 0.1, None, 4, 64)
    packed, scales, zp, block = nbits_arrays(bq)
    assert block == 64 and zp is None and packed.shape == (3, 1, 32)
    np.testing.assert_array_equal(_unpack_nbits(packed, 4).reshape(3, 64), q.numpy())
    odd = BlockQuant(torch.zeros(2, 48, dtype=torch.int8), torch.ones(2, 2), None, 4, 24)
    with pytest.raises(ValueError, match="group size 24 is not a multiple of 16"):
        nbits_arrays(odd)


def test_builder_failure_is_a_clear_error(tmp_path):
    from export.onnxruntime.genai_builder import BuilderError, build

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(BuilderError, match=r"(?s)onnxruntime-genai model builder failed \(fp32, cpu\): .*builder output"):
        build(tmp_path / "hf", tmp_path / "out")


def test_a_config_without_architectures_is_built_as_its_causal_lm():
    """A GGUF conversion's config.json has no ``architectures``; the builder indexes it unguarded
    (``TypeError: 'NoneType' object is not subscriptable``), so fix_config names the causal LM that
    builder_problems already assumed, and leaves a config that names one alone."""
    from transformers import LlamaConfig

    from export.onnxruntime.genai_builder import builder_problems, fix_config

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    assert not cfg.architectures and builder_problems(cfg) == []
    fix_config(cfg)
    assert cfg.architectures == ["LlamaForCausalLM"]
    named = LlamaConfig(architectures=["LlamaModel"])
    fix_config(named)
    assert named.architectures == ["LlamaModel"] and builder_problems(named)


def test_quantize_export_refuses_the_fused_graph(tmp_path):
    from targets.sources import RandomSource, load_model

    lm = load_model(RandomSource(config=dict(TINY_LLAMA), seed=0))
    res = OnnxRuntimeExporter().export(lm.model, lm.tokenizer, tmp_path / "f", {}, log=_quiet)
    with pytest.raises(ExportError, match="quantize_export runs ORT's quantizer on a dynamo export"):
        OnnxRuntimeExporter().quantize_export(res.artifact, tmp_path / "q", {"quantize": "dynamic"}, log=_quiet)


def test_the_builders_tokenizer_config_does_not_say_how_it_was_loaded(tmp_path):
    """The builder's ``from_pretrained`` echoes ``local_files_only`` into the tokenizer_config.json
    it saves, false or true as the process's ``HF_HUB_OFFLINE`` was at import: the same export
    then hashed differently in a test worker and its child. The key goes; the rest stays as written."""
    from export.onnxruntime.genai_builder import LOAD_ARGUMENTS, drop_load_arguments

    path = tmp_path / "tokenizer_config.json"
    kept = {"bos_token": "<|im_start|>", "model_max_length": 1024, "chat_template": "{{ 'é' }}"}
    for value in (True, False):
        path.write_text(json.dumps({**kept, "local_files_only": value}))
        drop_load_arguments(path)
        assert json.loads(path.read_text()) == kept and "local_files_only" in LOAD_ARGUMENTS
    before = path.read_bytes()
    drop_load_arguments(path)  # nothing to drop: the file is not rewritten
    assert path.read_bytes() == before
    drop_load_arguments(tmp_path / "absent.json")  # a builder that wrote none: nothing to do


@pytest.mark.parametrize("kleidiai", [False, True])
def test_kleidiai_is_off_unless_asked_in_every_runner(kleidiai, smollm2_tokenizer, tmp_path):
    """ONNX Runtime's ARM64 build runs MatMulNBits through KleidiAI, which quantizes activations per
    row, not per block: an int4 export then computes other numbers on Arm than were verified here
    (docs/devices.md). By default the export says ``mlas.disable_kleidiai`` where every runner reads
    it: the manifest's session (our InferenceSession runner) and genai_config.json (onnxruntime-genai,
    an app's too); ``arm64_kleidiai: true`` leaves it out. The x86-64 build loads either."""
    from export.onnxruntime.options import DISABLE_KLEIDIAI

    model = _family_model("llama")
    ex = OnnxRuntimeExporter()
    res = ex.export(model, smollm2_tokenizer, tmp_path, {"arm64_kleidiai": kleidiai, "max_seq_len": 64}, log=_quiet)
    want = {} if kleidiai else {DISABLE_KLEIDIAI: "1"}
    assert res.manifest["session"]["config_entries"] == want
    options = json.loads((tmp_path / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert (options.get(DISABLE_KLEIDIAI) == "1") is not kleidiai
    runner = ex.load(res.artifact)
    assert runner.describe()["session_config_entries"] == want
    genai = ex.load(res.extra_artifacts["genai"])
    assert greedy_generate(genai, IDS[:6], 4) == greedy_generate(runner, IDS[:6], 4)
