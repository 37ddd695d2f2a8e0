"""TorchChat target without compilers: HF -> model.pth + params.json -> the independent
Meta-layout forward reproduces the HF logits (several families, GQA/MHA, tied/untied), the
files obey torchchat's loader rules, quantized models carry the matching --quantize config,
and non-Llama models are refused from their config with the stage that would fix them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from export.base import ExportError, exporter_for_artifact, get_exporter
from export.torchchat.meta_llama import MetaLlamaRunner, ParamsError, expected_keys, load_checkpoint, parse_params
from export.torchchat.exporter import TorchChatOptions
from export.torchchat.layout import config_problems

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, initializer_range=0.2, vocab_size=49152)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
FAMILIES = {
    "llama-gqa-tied": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-mha-untied": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=False),
    "llama-mqa-llama3-rope": dict(model_type="llama", num_key_value_heads=1, rope_scaling=LLAMA3_ROPE),
    "mistral-window-fits": dict(model_type="mistral", num_key_value_heads=2, sliding_window=4096),
    "phi3-fused": dict(model_type="phi3", num_key_value_heads=2, pad_token_id=0, eos_token_id=2, bos_token_id=1),
}
PTH_ONLY = {"pte": False, "pt2": False, "max_seq_len": 64}


def _quiet(*_a, **_k):
    pass


def _model(spec: dict, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = copy.deepcopy(dict(BASE, **spec))  # transformers writes into a rope_scaling dict it is given
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _export(model, tokenizer, out: Path, **options):
    return get_exporter("torchchat").export(model, tokenizer, out, {**PTH_ONLY, **options}, log=_quiet)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_meta_layout_forward_reproduces_hf_logits(family, smollm2_tokenizer, tmp_path):
    """Prefill then token-by-token decode through model.pth + params.json equals HF eager (1e-4)."""
    model = _model(FAMILIES[family])
    res = _export(model, smollm2_tokenizer, tmp_path)
    assert res.details["probe"]["max_abs_diff"] <= 1e-4
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1))
    runner = MetaLlamaRunner(res.artifact)
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0]
    got = torch.cat([runner.forward(ids[:29])] + [runner.forward(ids[i:i + 1]) for i in range(29, 40)])
    assert ref.abs().max() > 1.0  # logits large enough that a wrong layout would show
    assert (got - ref).abs().max() <= 1e-4
    runner.reset()  # a clean cache gives the same answer again
    assert (runner.forward(ids) - ref).abs().max() <= 1e-4


def test_pth_is_plain_tensors_with_torchchats_exact_key_set(smollm2_tokenizer, tmp_path):
    tied = _export(_model(FAMILIES["llama-gqa-tied"]), smollm2_tokenizer, tmp_path / "tied")
    untied = _export(_model(FAMILIES["llama-mha-untied"]), smollm2_tokenizer, tmp_path / "untied")
    for res, tie in ((tied, True), (untied, False)):
        sd = torch.load(res.artifact, weights_only=True, mmap=True)
        assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in sd.values())
        params = parse_params(json.loads((res.artifact.parent / "params.json").read_text()))
        want = expected_keys(params) - ({"output.weight"} if tie else set())
        assert set(sd) == want  # strict: no rope.freqs, no extras; output.weight only when untied
        assert params.tie_word_embeddings is tie


def test_unpermuted_qk_is_caught_by_the_probe(smollm2_tokenizer, tmp_path, monkeypatch):
    """Negative control: skipping the rotate-half -> interleaved permutation changes the logits."""
    import export.torchchat.layout as layout

    monkeypatch.setattr(layout, "hf_to_meta_rope", lambda w, n: w.clone())
    with pytest.raises(ExportError, match="does not reproduce the model"):
        _export(_model(FAMILIES["llama-gqa-tied"]), smollm2_tokenizer, tmp_path)


def test_params_json_fields(smollm2_tokenizer, tmp_path):
    res = _export(_model(FAMILIES["llama-mqa-llama3-rope"]), smollm2_tokenizer, tmp_path, max_seq_len=64)
    params = json.loads((tmp_path / "params.json").read_text())
    assert params == {
        "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 1, "vocab_size": 49152, "hidden_dim": 128,
        "norm_eps": 1e-6, "rope_theta": 10000.0, "max_seq_length": 64,
        "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"},
        "use_hf_tokenizer": True, "tokenizer_prepend_bos": False,
    }
    assert res.details["params"] == params
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>" and "im_start" in cfg["chat_template"]


@pytest.mark.parametrize("change, message", [
    ({"max_position_embeddings": 256}, "does not accept: max_position_embeddings"),
    ({"rope_scaling": {"rope_theta": 1e4, "rope_type": "default"}}, "rope_scaling="),
    ({"head_dim": 32}, "torchchat always uses dim // n_heads = 16"),
    ({"rope_theta": None}, "lacks rope_theta"),
    ({"n_kv_heads": 3}, "must divide n_heads"),
    ({"model_type": "flamingo"}, "model_type"),
    ({"attention_bias": True}, "plain Llama only"),
])
def test_params_rejected_like_torchchats_loader(change, message):
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 100, "hidden_dim": 128,
              "norm_eps": 1e-5, "rope_theta": 1e4}
    parse_params(dict(params))
    params.update(change)
    params = {k: v for k, v in params.items() if v is not None}
    with pytest.raises(ParamsError, match=message):
        parse_params(params)


def test_checkpoint_loads_strictly(smollm2_tokenizer, tmp_path):
    res = _export(_model(FAMILIES["llama-mha-untied"]), smollm2_tokenizer, tmp_path)
    sd = torch.load(res.artifact, weights_only=True)
    torch.save({**sd, "rope.freqs": torch.zeros(8)}, tmp_path / "extra.pth")
    with pytest.raises(Exception, match="unexpected keys \\['rope.freqs'\\]"):
        load_checkpoint(tmp_path / "extra.pth", tmp_path / "params.json")
    torch.save({k: v for k, v in sd.items() if k != "output.weight"}, tmp_path / "nohead.pth")
    with pytest.raises(Exception, match="missing keys \\['output.weight'\\]"):  # untied: output.weight required
        load_checkpoint(tmp_path / "nohead.pth", tmp_path / "params.json")


@pytest.mark.parametrize("spec, fragments", [
    (dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4), ["LayerNorm; the `rmsnorm` stage rewrites it",
                                                             "learned absolute position", "GELU MLP", "biases"]),
    (dict(model_type="qwen2", num_key_value_heads=2), ["biases on the q/k/v projections"]),
    (dict(model_type="qwen3", num_key_value_heads=2), ["q_norm/k_norm"]),
    (dict(model_type="gemma", num_key_value_heads=2, head_dim=16), ["GeGLU"]),
    (dict(model_type="llama", head_dim=32), ["torchchat ignores head_dim"]),
    (dict(model_type="llama", hidden_act="gelu"), ["SwiGLU"]),
    (dict(model_type="llama", attention_bias=True), ["attention_bias=True"]),
    (dict(model_type="mistral", sliding_window=32), ["sliding-window attention (window 32)", "max_seq_len <= 32"]),
    (dict(model_type="phi3", partial_rotary_factor=0.5, pad_token_id=0), ["partial_rotary_factor=0.5"]),
    (dict(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}), ["rope_type='yarn'"]),
    (dict(model_type="falcon"), ["no mapping to torchchat's Llama layout"]),
])
def test_non_llama_models_are_refused_with_the_reason(spec, fragments):
    from transformers import AutoConfig

    cfg = copy.deepcopy(dict(BASE, **spec) if spec["model_type"] != "gpt2" else dict(spec, vocab_size=100))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    problems = get_exporter("torchchat").check_model(config, TorchChatOptions(max_seq_len=64))
    assert problems
    text = " | ".join(problems)
    for frag in fragments:
        assert frag in text, text


def test_rmsnorm_rewrite_removes_only_the_layernorm_problem():
    """With the rmsnorm stage's record (what its planned_config leaves), gpt2 is still refused, but
    no longer for LayerNorm."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100)
    config.edge_optimize_rmsnorm = {"mode": "exact", "norms": [], "added_bias": []}
    problems = config_problems(config, 64)
    assert problems and not any("LayerNorm" in p for p in problems)


def test_validate_refuses_before_any_stage(tmp_path):
    """The pipeline's pre-flight (optimize validate) reports the exporter's refusal with the fix."""
    from optimize.config import load_config
    from optimize.config_checks import model_problems

    cfg = load_config({"version": 1, "name": "t", "target": "torchchat", "output_dir": str(tmp_path),
                       "model": {"source": "random", "config": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                                                                "n_head": 4, "vocab_size": 49152}}},
                      check_model=False)
    problems = model_problems(cfg)
    assert any(where == "target" and "`rmsnorm` stage" in msg and "torchchat" in msg for where, msg in problems)


def test_layers_of_different_widths_are_refused(smollm2_tokenizer, tmp_path):
    """An unevenly pruned MLP cannot be written as one params.json hidden_dim."""
    model = _model(FAMILIES["llama-gqa-tied"])
    mlp = model.model.layers[1].mlp
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
    mlp.down_proj = torch.nn.Linear(96, 64, bias=False)
    with pytest.raises(ExportError, match="layers.1.feed_forward.w1.weight has shape \\(96, 64\\).*cannot be expressed"):
        _export(model, smollm2_tokenizer, tmp_path)


def test_quantized_model_gets_dequantized_pth_and_matching_quantize_config(smollm2_tokenizer, tmp_path):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, PerGroup, quantize_

    model = _model(FAMILIES["llama-gqa-tied"])
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
              lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              lambda m, fqn: fqn == "lm_head")
    res = _export(model, smollm2_tokenizer, tmp_path)
    assert res.details["torchchat_quantize"] == {"linear:a8w4dq": {"groupsize": 32}}
    run_md = (tmp_path / "RUN.md").read_text()
    assert """--quantize '{"linear:a8w4dq": {"groupsize": 32}}'""" in run_md and "cannot reproduce the mix" in run_md
    sd = torch.load(res.artifact, weights_only=True)
    # the .pth holds exactly the de-quantized weights (on the int4 grid), v is unpermuted
    w_v = model.model.layers[0].self_attn.v_proj.weight.dequantize()
    assert torch.equal(sd["layers.0.attention.wv.weight"], w_v)
    assert "output.weight" in sd  # lm_head was quantized separately: no longer tied
    with pytest.raises(ExportError, match="quantized_pth is 'refuse'"):
        _export(model, smollm2_tokenizer, tmp_path / "refused", quantized_pth="refuse")


def test_8da8w_maps_to_int8_with_a_note(smollm2_tokenizer, tmp_path):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, quantize_

    model = _model(FAMILIES["llama-mha-untied"])
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)))
    res = _export(model, smollm2_tokenizer, tmp_path)
    assert res.details["torchchat_quantize"] == {"linear:int8": {"bitwidth": 8, "groupsize": 0}}
    assert "no portable int8-activation/int8-weight mode" in (tmp_path / "RUN.md").read_text()


def test_sentencepiece_tokenizer_is_shipped_as_tokenizer_model(tmp_path):
    import sentencepiece as spm
    from pydoc_data.topics import topics
    from transformers import LlamaTokenizer

    (tmp_path / "text.txt").write_text("\n".join(list(topics.values())[:10]))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=300, model_type="bpe", minloglevel=2)
    tok = LlamaTokenizer(vocab_file=str(tmp_path / "sp.model"))
    res = _export(_model(dict(FAMILIES["llama-gqa-tied"], vocab_size=300)), tok, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()
    params = json.loads((out / "params.json").read_text())
    assert "use_hf_tokenizer" not in params and not (out / "tokenizer.json").exists()  # SentencePiece is the default
    assert res.manifest["tokenizer"]["tokenizer_type"] == 2
    assert "aoti_run" not in (out / "RUN.md").read_text()  # no .pt2 written here, so no runner line for it


@pytest.mark.parametrize("options, message", [
    ({"max_seq_len": 1}, "greater than or equal to 2"),
    ({"quantized_pth": "keep"}, "'dequantize' or 'refuse'"),
    ({"tolerance": 0}, "greater than 0"),
    ({"pte_path": "x"}, "unknown key 'pte_path'.*allowed keys"),
])
def test_option_errors_name_the_problem(options, message):
    with pytest.raises(ValidationError, match=message):
        TorchChatOptions.model_validate(options)


def test_artifacts_dispatch_to_the_torchchat_loader(smollm2_tokenizer, tmp_path):
    assert exporter_for_artifact(Path("model.pth")).name == "torchchat"
    assert exporter_for_artifact(Path("model.pt2")).name == "torchchat"
    with pytest.raises(ExportError, match="loads .pth, .pte and .pt2"):
        get_exporter("torchchat").load(Path("model.onnx"))
    # an export directory (optimize run <dir>): the .pt2 when there is one, else the .pth
    _export(_model(FAMILIES["llama-gqa-tied"]), smollm2_tokenizer, tmp_path / "out")
    exporter = exporter_for_artifact(tmp_path / "out")
    assert exporter.name == "torchchat"
    assert isinstance(exporter.load(tmp_path / "out"), MetaLlamaRunner)
    (tmp_path / "other").mkdir()
    with pytest.raises(ExportError, match="not a torchchat export directory"):
        exporter.load(tmp_path / "other")


def test_context_longer_than_the_model_is_refused_at_validation():
    from transformers import LlamaConfig

    config = LlamaConfig(**{k: v for k, v in BASE.items()}, num_key_value_heads=2)
    assert get_exporter("torchchat").check_model(config, TorchChatOptions(max_seq_len=256)) == []
    problems = get_exporter("torchchat").check_model(config, TorchChatOptions(max_seq_len=512))
    assert problems == ["max_seq_len=512 exceeds the model's max_position_embeddings=256"]


def test_failed_export_leaves_the_previous_directory_whole(smollm2_tokenizer, tmp_path, monkeypatch):
    """The directory is swapped in whole: a failure late in the export (here the AOTInductor
    compile) keeps the previous complete export and its manifest."""
    import export.torchchat.aoti as aoti

    model = _model(FAMILIES["llama-gqa-tied"])
    _export(model, smollm2_tokenizer, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def broken(*_a, **_k):
        raise ExportError("compiler missing")

    monkeypatch.setattr(aoti, "compile_package", broken)
    with pytest.raises(ExportError, match="compiler missing"):
        _export(_model(FAMILIES["llama-gqa-tied"], seed=1), smollm2_tokenizer, tmp_path / "out", pt2=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind


def test_max_seq_len_defaults_to_the_profiles(tmp_path):
    """The pipeline fills export.torchchat.max_seq_len from the target profile; the YAML wins."""
    from optimize.config import load_config
    from optimize.config_checks import export_options
    from targets import load_target

    profile = load_target("torchchat")
    base = {"version": 1, "name": "t", "target": "torchchat", "output_dir": str(tmp_path),
            "model": {"source": "random", "config": {"model_type": "llama", **BASE, "num_key_value_heads": 2}}}
    cfg = load_config(base, check_model=False)
    assert export_options(cfg, "torchchat", profile).max_seq_len == profile.max_seq_len
    cfg = load_config({**base, "export": {"torchchat": {"max_seq_len": 128}}}, check_model=False)
    assert export_options(cfg, "torchchat", profile).max_seq_len == 128
