"""ptq_int8: torchao 8da8w / 8da4w on a tiny Llama (fast) and on the real SmolLM2 (slow)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from optimize.stage_api import StageContext, get_stage
from optimize.module_select import matches, resolve_patterns, select_modules
from optimize.stages.ptq_int8 import Ptq8Config


def _ctx() -> StageContext:
    return StageContext(tokenizer=None, calibration=[], train_ids=torch.zeros(0, dtype=torch.long),
                        target=None, work_dir=Path("."), log=lambda s: None)


def _run(model, **opts):
    spec = get_stage("ptq_int8")
    ctx = _ctx()
    out = spec.fn(model, spec.config_cls(**opts), ctx)
    return out, ctx.details


def _is_plain_fp32_linear(mod: nn.Module) -> bool:
    return type(mod) is nn.Linear and type(mod.weight) is nn.Parameter and mod.weight.dtype == torch.float32


def _is_quantized(mod: nn.Module) -> bool:
    from torchao.utils import TorchAOBaseTensor

    return isinstance(mod.weight, TorchAOBaseTensor)


IDS = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))


def test_registered_with_description_and_scheme():
    spec = get_stage("ptq_int8")
    assert spec.config_cls is Ptq8Config
    assert "8da8w" in spec.description and "GPTQ" in spec.description
    assert Ptq8Config().quant_scheme() == "8da8w"
    assert Ptq8Config(scheme="8da4w").quant_scheme() == "8da4w"
    assert not hasattr(Ptq8Config, "needs_calibration")  # removed: the runner always prepares calibration text
    for name, field in Ptq8Config.model_fields.items():
        if name != "kind":
            assert field.description, name


@pytest.mark.parametrize(
    "opts,bits",
    [
        (dict(scheme="8da8w"), 8),
        (dict(scheme="8da4w"), 4),
        (dict(scheme="8da4w", group_size=64, keep_high_precision=[]), 4),
        (dict(scheme="8da4w", weight_qparams="hqq_scale_only"), 4),
    ],
)
def test_scheme_runs_keeps_shape_and_generates(tiny_llama, opts, bits):
    with torch.no_grad():
        ref = tiny_llama(IDS).logits
    model, details = _run(copy.deepcopy(tiny_llama), **opts)
    with torch.no_grad():
        out = model(IDS).logits
    assert out.shape == ref.shape and torch.isfinite(out).all()
    # a random-init tiny model has tiny logits; quantization error must stay small relative to them
    assert (out - ref).abs().max() < 0.5 * ref.abs().max() + 1e-3
    assert details["scheme"] == opts["scheme"] and details["weight_bits"] == bits
    assert details["group_size"] == (opts.get("group_size", 32) if bits == 4 else None)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert details["linear_quantized"] + details["linear_kept"] == n_linear
    q = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _is_quantized(m)]
    assert len(q) == details["linear_quantized"]
    gen = model.generate(IDS, max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, IDS.shape[1] + 3)


def test_default_keeps_lm_head_fp32_and_tied(tiny_llama):
    model, details = _run(copy.deepcopy(tiny_llama))
    assert details["kept_modules"] == ["lm_head"]
    assert _is_plain_fp32_linear(model.lm_head)
    # kept lm_head still shares the fp32 embedding table: no extra bytes
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert details["untied_embeddings"] is False
    assert all(_is_quantized(m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head")


def test_keep_high_precision_patterns_are_plain_fp32(tiny_llama):
    keep = ["model.layers.0.*", "*.down_proj"]
    model, details = _run(copy.deepcopy(tiny_llama), keep_high_precision=keep)
    kept = set(details["kept_modules"])
    assert "model.layers.0.self_attn.q_proj" in kept and "model.layers.1.mlp.down_proj" in kept
    assert "lm_head" not in kept  # a user list replaces the default
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            assert _is_plain_fp32_linear(mod) == (name in kept), name
    # lm_head was quantized: the tie is broken and the config says so
    assert details["untied_embeddings"] is True and model.config.tie_word_embeddings is False
    assert type(model.model.embed_tokens.weight) is nn.Parameter


def test_modules_restricts_selection(tiny_llama):
    model, details = _run(copy.deepcopy(tiny_llama), modules=["*.mlp.*"])
    assert details["linear_quantized"] == 2 * 3
    assert _is_quantized(model.model.layers[1].mlp.up_proj)
    assert _is_plain_fp32_linear(model.model.layers[1].self_attn.o_proj)


@pytest.mark.parametrize("emb", ["int8", "int4"])
def test_quantize_embedding(tiny_llama, emb):
    model, details = _run(copy.deepcopy(tiny_llama), quantize_embedding=emb)
    assert details["embedding_quantized"] == emb
    assert _is_quantized(model.model.embed_tokens) and _is_plain_fp32_linear(model.lm_head)
    assert model.config.tie_word_embeddings is False
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


def test_quantized_model_exports(tiny_llama):
    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    model, _ = _run(copy.deepcopy(tiny_llama), scheme="8da4w")
    ep = torch.export.export(Logits(model), (IDS,), strict=False)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "torchao.dequantize_affine.default" in targets  # the pattern XNNPACK's partitioner lowers
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(IDS), Logits(model)(IDS))


@pytest.mark.parametrize(
    "opts,text",
    [
        (dict(scheme="int3"), "8da8w"),
        (dict(scheme="8da4w", group_size=0), "greater than 0"),
        (dict(scheme="8da4w", group_size=48), "not a multiple of 32"),
        (dict(scheme="8da8w", group_size=32), "only to scheme 8da4w"),
        (dict(group_sise=32), "did you mean 'group_size'"),
        (dict(quantize_embedding="int2"), "int8"),
        (dict(quantize_embedding="int8", keep_high_precision=["embeddings"]), "conflicts"),
        (dict(embedding_group_size=32), "only to quantize_embedding: int4"),
        (dict(modules=[]), "at least 1"),
        (dict(weight_qparams="gptq"), "hqq_scale_only"),
    ],
)
def test_bad_config_messages(opts, text):
    with pytest.raises(ValidationError, match=text):
        Ptq8Config(**opts)


def test_group_size_must_divide_in_features(tiny_llama):
    # hidden 64: 128 is a multiple of 32 but does not divide the attention projections' in_features
    with pytest.raises(ValueError, match=r"group_size=128 does not divide the in_features of 12 layer\(s\), "
                       r"e\.g\. model\.layers\.0\.self_attn\.q_proj \(in_features=64\).*fit every layer: 32, 64$"):
        _run(copy.deepcopy(tiny_llama), scheme="8da4w", group_size=128)


TINY_GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=49152)


@pytest.mark.parametrize(
    "stage,model,message",
    [
        ({"scheme": "8da4w", "group_size": 128}, None,
         r"group_size=128 does not divide the in_features of 12 layer\(s\), e\.g\. model\.layers\.0\.self_attn"
         r"\.q_proj \(in_features=64\).*group sizes that fit every layer: 32, 64"),
        ({"scheme": "8da4w", "keep_high_precision": []}, dict(intermediate_size=80),  # down_proj reads 80 columns
         r"group_size=32 does not divide.*\.mlp\.down_proj \(in_features=80\); group sizes that fit every layer: "
         r"none of \[32, 64, 128, 256\] \(keep the odd layers in higher precision\)"),
        ({"keep_high_precision": ["lm_haed"]}, None, r"pattern\(s\) \['lm_haed'\] match no module of LlamaForCausalLM"),
        ({"quantize_embedding": "int4", "embedding_group_size": 48}, None,
         "embedding_group_size=48 does not divide the embedding width 64; choose one that does"),
        ({}, TINY_GPT2, "GPT2LMHeadModel uses transformers Conv1D .GPT-2 family. for 8 projections"),
    ],
)
def test_refused_at_validation_from_the_config(tiny_cfg, stage, model, message):
    """Pre-flight: load_config (optimize validate) refuses what ptq_int8 would refuse after loading."""
    from optimize import load_config
    from optimize.errors import ConfigError

    if model is not None:
        tiny_cfg["model"]["config"] = dict(TINY_GPT2) if "model_type" in model else {**tiny_cfg["model"]["config"], **model}
    tiny_cfg["stages"] = [{"kind": "ptq_int8", **stage}]
    with pytest.raises(ConfigError, match=r"stages\.0: stage '0:ptq_int8': " + message):
        load_config(tiny_cfg)


def test_pattern_typo_and_empty_selection(tiny_llama):
    with pytest.raises(ValueError, match="match no module"):
        _run(copy.deepcopy(tiny_llama), keep_high_precision=["lm_haed"])
    with pytest.raises(ValueError, match="no nn.Linear layer is left"):
        _run(copy.deepcopy(tiny_llama), modules=["lm_head"], keep_high_precision=["lm_head"])


def test_second_quantization_refused(tiny_llama):
    model, _ = _run(copy.deepcopy(tiny_llama))
    with pytest.raises(ValueError, match="already quantized"):
        _run(model)


def test_gpt2_conv1d_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=256, n_positions=64)).eval()
    with pytest.raises(ValueError, match="Conv1D"):
        _run(model)
    # deliberately quantizing only its nn.Linear layers is allowed and reported
    _, details = _run(model, modules=["lm_head"], keep_high_precision=[])
    assert details["linear_quantized"] == 1 and details["conv1d_kept_fp32"]


def test_select_helpers(tiny_llama):
    assert resolve_patterns(tiny_llama, ["lm_head", "embeddings", "x.*"]) == ["lm_head", "model.embed_tokens", "x.*"]
    assert matches("model.layers.0.mlp.up_proj", ["model.layers.0"])  # a parent selects its children
    assert not matches("model.layers.10.mlp", ["model.layers.1"])
    sel, kept = select_modules(tiny_llama, nn.Linear, include=["*.mlp.*"], exclude=["*.down_proj"])
    assert sel == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                   "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert "lm_head" in kept


@pytest.mark.slow
def test_smollm2_8da8w_default_within_2pct(smollm2_loaded, pydoc_splits):
    """The pipeline default (8da8w, lm_head fp32) costs < 2% perplexity on real SmolLM2.

    1024 eval targets in two 512-token windows: eager torchao int8 is slow on this CPU.
    """
    from export.decoding.runtime import EagerRunner
    from export.verify import perplexity

    ids = pydoc_splits.eval_ids[:1025]
    t0 = time.perf_counter()
    base = perplexity(EagerRunner(smollm2_loaded.model), ids, 512)["perplexity"]
    model, details = _run(copy.deepcopy(smollm2_loaded.model))
    q = perplexity(EagerRunner(model), ids, 512)["perplexity"]
    elapsed = time.perf_counter() - t0
    print(f"\nSmolLM2 ppl fp32 {base:.3f}  8da8w {q:.3f}  (+{100 * (q / base - 1):.2f}%)  {elapsed:.1f}s")
    assert details["linear_quantized"] == 210 and details["kept_modules"] == ["lm_head"]
    assert q / base < 1.02
