"""prune stage: clear errors (at validate time where the config alone shows them), the planned
config that later checks see, and pruned tiny Llama / Qwen2 models that export to ExecuTorch and
ONNX Runtime, match eager there, and are smaller than the unpruned weights."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from optimize.errors import ConfigError
from optimize.stage_api import StageContext, get_stage
from optimize.stages.prune import PruneConfig

GQA_LLAMA = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=12, num_key_value_heads=3, vocab_size=49152)


def validate(tiny_cfg, stages, model=None):
    from optimize.config import load_config

    if model is not None:
        tiny_cfg["model"]["config"] = model
    tiny_cfg["stages"] = stages
    return load_config(tiny_cfg)


def problems(tiny_cfg, stage, model=None) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(tiny_cfg, [stage], model)
    return str(exc.value)


def test_bad_options_are_refused_by_the_schema():
    with pytest.raises(ValidationError, match=r"mlp_ratio=1.0 is out of range: .* must be in \[0, 1\)"):
        PruneConfig(method="width", mlp_ratio=1.0)
    with pytest.raises(ValidationError, match=r"mlp_ratio=-0.1 is out of range"):
        PruneConfig(method="width", mlp_ratio=-0.1)
    with pytest.raises(ValidationError, match=r"sparsity=1.5 is out of range: .* must be in \(0, 1\)"):
        PruneConfig(method="unstructured", sparsity=1.5)
    with pytest.raises(ValidationError, match="sparsity do\\(es\\) not apply to method 'depth'; its options: "
                                              "block_score, num_hidden_layers"):
        PruneConfig(method="depth", num_hidden_layers=2, sparsity=0.5)
    with pytest.raises(ValidationError, match="method depth needs num_hidden_layers"):
        PruneConfig(method="depth")
    with pytest.raises(ValidationError, match="method width needs num_attention_heads, num_key_value_heads, mlp_ratio and/or hidden_size"):
        PruneConfig(method="width", channel_multiple=16)
    with pytest.raises(ValidationError, match="method unstructured needs sparsity"):
        PruneConfig(method="unstructured")
    with pytest.raises(ValidationError, match="method\n  Input should be 'depth', 'width', 'unstructured' or"):
        PruneConfig(method="2:4")
    with pytest.raises(ValidationError, match="unknown key 'ratio'"):
        PruneConfig(method="width", ratio=0.5)


@pytest.mark.parametrize("options, message", [
    (dict(method="depth", num_hidden_layers=0), "num_hidden_layers\n  Input should be greater than or equal to 1"),
    (dict(method="depth", num_hidden_layers=2, block_score="cos"), "block_score\n  Input should be 'block_influence' or 'loss'"),
    (dict(method="unstructured", sparsity=0.5, score="l1"), "score\n  Input should be 'magnitude' or 'wanda'"),
    (dict(method="width", mlp_ratio=0.5, channel_multiple=0), "channel_multiple\n  Input should be greater than or equal to 1"),
    (dict(method="depth", num_hidden_layers=2, calibration_windows=0), "calibration_windows\n  Input should be greater than"),
    (dict(method="semi_structured", modules=[]), "modules\n  List should have at least 1 item"),
    (dict(method="width", hidden_size=0), "hidden_size\n  Input should be greater than or equal to 1"),
    (dict(method="width", num_attention_heads=0), "num_attention_heads\n  Input should be greater than or equal to 1"),
    (dict(method="width", num_key_value_heads=0), "num_key_value_heads\n  Input should be greater than or equal to 1"),
    (dict(method="semi_structured", sparsity=0.5), "sparsity do\\(es\\) not apply to method 'semi_structured'"),
    (dict(method="unstructured", sparsity=0.5, mlp_ratio=0.5), "mlp_ratio do\\(es\\) not apply to method 'unstructured'"),
])
def test_every_option_refuses_a_wrong_value(options, message):
    with pytest.raises(ValidationError, match=message):
        PruneConfig(**options)


def test_model_problems_are_refused_at_validate_time(tiny_cfg):
    msg = problems(tiny_cfg, {"kind": "prune", "method": "width", "num_attention_heads": 7}, GQA_LLAMA)
    assert "stages.0" in msg and "num_attention_heads=7 breaks GQA: it must be a multiple of the 3 KV heads" in msg
    assert "3, 6, 9, 12" in msg
    msg = problems(tiny_cfg, {"kind": "prune", "method": "width", "num_attention_heads": 9}, GQA_LLAMA)
    assert "num_attention_heads=9 does not divide hidden_size=96, which transformers' llama config requires" in msg
    assert "[3, 6, 12]" in msg
    msg = problems(tiny_cfg, {"kind": "prune", "method": "width", "num_key_value_heads": 4}, GQA_LLAMA)
    assert "num_key_value_heads=4 exceeds the model's 3" in msg
    msg = problems(tiny_cfg, {"kind": "prune", "method": "width", "num_attention_heads": 6, "num_key_value_heads": 1},
                   GQA_LLAMA)
    assert "needs 6 query heads per group, but each group has 4; keep at most 4" in msg
    msg = problems(tiny_cfg, {"kind": "prune", "method": "depth", "num_hidden_layers": 3}, GQA_LLAMA)
    assert "num_hidden_layers=3 keeps every one of the model's 3 blocks; choose 1..2" in msg
    msg = problems(tiny_cfg, {"kind": "prune", "method": "width", "hidden_size": 128}, GQA_LLAMA)
    assert "hidden_size=128 exceeds the model's 96; pruning only removes channels" in msg
    msg = problems(tiny_cfg, {"kind": "prune", "method": "width", "hidden_size": 64}, GQA_LLAMA)
    assert "num_attention_heads=12 does not divide hidden_size=64" in msg
    msg = problems(tiny_cfg, {"kind": "prune", "method": "width", "mlp_ratio": 0.9}, GQA_LLAMA)
    assert "mlp_ratio=0.9 leaves 12 of 128 MLP channels, under one channel_multiple (32)" in msg
    gpt2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=49152)
    msg = problems(tiny_cfg, {"kind": "prune", "method": "depth", "num_hidden_layers": 1}, gpt2)
    assert ("depth pruning supports the decoder families llama, mistral, qwen2, qwen3, phi3, gemma, gemma2, "
            "gemma3_text; this model is 'gpt2'") in msg
    # unstructured works on any nn.Linear model, so gpt2 passes validation
    validate(tiny_cfg, [{"kind": "prune", "method": "unstructured", "sparsity": 0.5}], gpt2)


def test_later_stages_are_checked_against_the_pruned_shape(tiny_cfg):
    stage = PruneConfig(method="width", num_key_value_heads=1, mlp_ratio=0.25)
    from transformers import AutoConfig as AC

    planned = stage.planned_config(AC.for_model(**GQA_LLAMA))
    assert (planned.num_attention_heads, planned.num_key_value_heads, planned.intermediate_size, planned.head_dim) \
        == (4, 1, 96, 8)
    depth = PruneConfig(method="depth", num_hidden_layers=2).planned_config(AC.for_model(**GQA_LLAMA))
    assert depth.num_hidden_layers == 2
    # a group size fits the original MLP (128) but not the pruned one (96): refused before any stage runs
    wide = dict(GQA_LLAMA, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=r"stages.1.*group_size=64 does not divide the in_features of 3 layer"
                                          r"\(s\), e.g. model.layers.0.mlp.down_proj \(in_features=96\)"):
        validate(tiny_cfg, [{"kind": "prune", "method": "width", "mlp_ratio": 0.25},
                            {"kind": "qat", "scheme": "8da4w", "group_size": 64}], wide)
    validate(tiny_cfg, [{"kind": "qat", "scheme": "8da4w", "group_size": 64}], wide)  # fine unpruned


def test_runtime_refusals(tiny_llama):
    ctx = StageContext(tokenizer=None, calibration=[], train_ids=None, target=None, work_dir=None, log=lambda s: None)
    with pytest.raises(ValueError, match="method depth scores importance on calibration text, but ctx.calibration "
                                         "is empty"):
        get_stage("prune").fn(tiny_llama, PruneConfig(method="depth", num_hidden_layers=1), ctx)
    with pytest.raises(ValueError, match=r"pattern\(s\) \['model.layerz.\*'\] match no module"):
        get_stage("prune").fn(tiny_llama, PruneConfig(method="semi_structured", score="magnitude",
                                                      modules=["model.layerz.*"]), ctx)
    from optimize.stages.ptq_int8 import Ptq8Config

    quantized = get_stage("ptq_int8").fn(copy.deepcopy(tiny_llama), Ptq8Config(), ctx)
    ctx.calibration = [torch.randint(0, 1000, (32,))]
    with pytest.raises(ValueError, match="not a plain tensor; prune before quantizing"):
        get_stage("prune").fn(quantized, PruneConfig(method="depth", num_hidden_layers=1), ctx)


@pytest.mark.slow
def test_pipeline_prune_then_distill_resumes_from_the_pruned_checkpoint(tiny_cfg):
    """A pruned checkpoint reloads with its smaller config and its pruning record, so a distill
    stage added later (resumed run) still maps the student's blocks to the teacher blocks kept."""
    from optimize import run_pipeline

    tiny_cfg["model"]["config"] = dict(tiny_cfg["model"]["config"], num_hidden_layers=4)
    tiny_cfg["checks"]["latency"]["enabled"] = False
    prune = {"kind": "prune", "method": "depth", "num_hidden_layers": 2, "gates": {"on_fail": "warn"}}
    first = run_pipeline(validate(tiny_cfg, [prune]), say=lambda m: None)
    row = first.row("0:prune")
    kept = row.details["kept_blocks"]
    assert row.metrics.params < first.row("baseline").metrics.params
    assert row.details["params"] == [first.row("baseline").metrics.params, row.metrics.params]
    distill = {"kind": "distill", "steps": 2, "seq_len": 32, "hidden_weight": 1.0, "gates": {"on_fail": "warn"}}
    again = run_pipeline(validate(tiny_cfg, [prune, distill]), say=lambda m: None)
    assert again.row("0:prune").status == "resumed"
    d = again.row("1:distill").details
    assert d["layer_map"] == {"0": kept[0], "1": kept[1]} and d["layer_map_from"] == "pruning record"


# ------------------------------------------------------------------ exports (slow)

def _chain(model, stages, calib):
    ctx = StageContext(tokenizer=None, calibration=calib, train_ids=None, target=None, work_dir=None,
                       log=lambda s: None)
    details = []
    for s in stages:
        model = get_stage("prune").fn(model, PruneConfig(**s), ctx)
        details.append(dict(ctx.details))
        ctx.details.clear()
    return model, details


CASES = {
    # tiny Llama: depth, query heads per group, MLP width, embedding channels, then 50% unstructured
    # (Wanda) and 2:4 (magnitude) on the attention projections
    "llama": (dict(model_type="llama", hidden_size=64, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2),
              [dict(method="depth", num_hidden_layers=2),
               dict(method="width", num_attention_heads=2, mlp_ratio=0.25, hidden_size=48),
               dict(method="unstructured", sparsity=0.5, score="wanda"),
               dict(method="semi_structured", modules=["*.self_attn.*"], score="magnitude")],
              (2, 2, 2, 384)),
    # tiny Qwen2 (q/k/v biases): depth by loss, whole KV groups, then 2:4 on the MLPs (Wanda) and
    # 25% unstructured (magnitude) on the attention projections
    "qwen2": (dict(model_type="qwen2", hidden_size=64, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2),
              [dict(method="depth", num_hidden_layers=2, block_score="loss"),
               dict(method="width", num_key_value_heads=1),
               dict(method="semi_structured", modules=["*.mlp.*"]),
               dict(method="unstructured", sparsity=0.25, score="magnitude", modules=["*.self_attn.*"])],
              (2, 2, 1, 512)),
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family", list(CASES))
def test_pruned_model_reloads_and_exports_smaller(family, tmp_path, smollm2_tokenizer):
    from export.executorch.exporter import ExecuTorchExporter
    from export.onnxruntime.exporter import OnnxRuntimeExporter
    from export.decoding.runtime import EagerRunner
    from export.verify import logits_parity
    from targets.sources import RandomSource, load_model

    config, stages, expected = CASES[family]
    loaded = load_model(RandomSource(config={**config, "vocab_size": 49152, "max_position_embeddings": 256,
                                             "initializer_range": 0.1}, seed=0))
    model = loaded.model.eval()
    before = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(2))
    pruned, details = _chain(model, stages, [ids[:64], ids[64:128]])
    c = pruned.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == expected
    assert c.hidden_size == (48 if family == "llama" else 64)
    after = sum(p.numel() for p in pruned.parameters())
    assert details[0]["params"] == [before, details[0]["params"][1]] and details[-1]["params"][1] == after < before
    assert [r["method"] for r in c.pruning] == [s["method"] for s in stages]

    pruned.save_pretrained(tmp_path / "hf")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids[None, :32]).logits, pruned(ids[None, :32]).logits, rtol=0, atol=1e-6)
    # the zeros of both sparse methods are in the reloaded weights (what the exporters read)
    from optimize.prune.sparsity import is_n_of_m

    weights = {n: m.weight for n, m in again.named_modules() if isinstance(m, torch.nn.Linear)}
    for rec in again.config.pruning:
        for name in rec.get("modules", []):
            w = weights[name]
            if rec["method"] == "semi_structured":
                assert is_n_of_m(w), name
            elif rec["method"] == "unstructured":
                sparsity = next(s["sparsity"] for s in stages if s["method"] == "unstructured")
                assert ((w == 0).float().mean(dim=1) >= sparsity - 1e-6).all(), name

    eager = EagerRunner(pruned)
    window = [ids[128:160]]
    pte = ExecuTorchExporter().export(pruned, loaded.tokenizer, tmp_path / "et", {"max_seq_len": 64},
                                      log=lambda *a: None)
    onnx = OnnxRuntimeExporter().export(pruned, loaded.tokenizer, tmp_path / "ort", {}, log=lambda *a: None)
    # fp32 weights of the unpruned model: the pruned artifacts (weights + < 0.5 MB of graph) stay below it.
    # The 49152-token embedding and head dominate these tiny models, so the blocks are made wide
    # enough (MLP 512) for what pruning removes to outweigh the graph overhead.
    dense_bytes = 4 * before
    for exp, res in ((ExecuTorchExporter(), pte), (OnnxRuntimeExporter(), onnx)):
        runner = exp.load(res.artifact)
        parity = logits_parity(eager, runner, window)
        assert parity["max_abs_diff"] < 1e-4 and parity["top1_agreement"] == 1.0, (exp.name, parity)
        size = runner.size_bytes()
        assert 4 * after <= size < dense_bytes, (exp.name, size, 4 * after, dense_bytes)
        runner.close()


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [dict(method="depth", num_hidden_layers=1),
                                     dict(method="width", num_attention_heads=2, num_key_value_heads=1, mlp_ratio=0.5),
                                     dict(method="semi_structured")])
def test_prune_scores_and_cuts_where_the_pipeline_placed_the_model(tmp_path, device, options):
    """CPU calibration windows, the model on ``device``: the pruned model is there too and
    computes the same logits as the same cut made on the CPU."""
    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    base = family("llama")
    g = torch.Generator().manual_seed(2)
    windows = [torch.randint(1, 500, (48,), generator=g) for _ in range(2)]
    probe = torch.randint(1, 500, (1, 24), generator=g)
    out = {}
    for where in ("cpu", device):
        ctx = StageContext(tokenizer=None, calibration=windows, train_ids=torch.zeros(0, dtype=torch.long),
                           target=None, work_dir=tmp_path, log=lambda s: None, device=torch.device(where))
        model = get_stage("prune").fn(copy.deepcopy(base).to(where), PruneConfig(**options), ctx)
        assert all(p.device.type == where for p in model.parameters())
        with torch.no_grad():
            out[where] = (model(probe.to(where)).logits.cpu(), ctx.details)
    (a, da), (b, db) = out["cpu"], out[device]
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert da.get("kept_blocks") == db.get("kept_blocks") and da.get("kept_heads") == db.get("kept_heads")
