"""The pipeline's ``draft`` block: validation refuses what cannot work before any stage runs, and a run
makes the draft with its own rows (its own gates, resumable), exports it as the ``.pte``'s ``draft``
method beside ``verify``, and checks that drafting with it keeps plain greedy's tokens."""

from __future__ import annotations

import json

import pytest
import torch

from optimize import load_config, run_pipeline
from optimize.errors import ConfigError

MODEL = {"source": "random", "config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                        "vocab_size": 49152, "initializer_range": 0.2}}
DRAFT_STAGES = [{"kind": "prune", "method": "depth", "num_hidden_layers": 1},
                {"kind": "distill", "steps": 3, "seq_len": 64, "frozen": ["embeddings"]},
                {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32}]


def _cfg(**over) -> dict:
    cfg = {"version": 1, "name": "draft", "model": MODEL,
           "data": {"eval_tokens": 512, "calibration_tokens": 256, "seq_len": 128},
           "checks": {"latency": {"runs": 1, "decode_tokens": 8, "prompt_tokens": 32}, "memory": False},
           "target": "executorch",
           "stages": [{"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32}],
           "draft": {"stages": DRAFT_STAGES},
           "export": {"executorch": {"max_seq_len": 128, "verify_tokens": 5, "draft_vocab": 4096}}}
    cfg.update(over)
    return cfg


def _problems(cfg: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    return {path: msg for path, msg in err.value.problems}


def test_a_draft_that_cannot_work_is_refused_at_validation():
    assert load_config(_cfg()).draft.stages[0].kind == "prune"
    # a typo names its path and the allowed keys; a draft has at least one stage
    assert "allowed keys: gates, stages" in _problems(_cfg(draft={"stagse": DRAFT_STAGES}))["draft.stagse"]
    assert "draft.stages" in _problems(_cfg(draft={"stages": []}))
    # the verify method checks a draft's tokens
    p = _problems(_cfg(export={"executorch": {"max_seq_len": 128}}))
    assert "verify_tokens" in p["draft"]
    # a runtime whose exporter writes no draft
    p = _problems(_cfg(target="onnxruntime", export={}))
    assert "writes no draft model" in p["draft"]
    # draft_vocab sizes a draft's head: not without one, not past the vocabulary
    p = _problems(_cfg(draft=None))
    assert "no draft block" in p["export.executorch.draft_vocab"]
    p = _problems(_cfg(export={"executorch": {"max_seq_len": 128, "verify_tokens": 5, "draft_vocab": 60000}}))
    assert "more than the model's 49152" in p["export.executorch.draft_vocab"]
    # a quantized target beside an fp32 draft reads more bytes a draft token than it saves
    p = _problems(_cfg(draft={"stages": DRAFT_STAGES[:2]}))
    assert "add a ptq_int8 stage to the draft" in p["draft.stages"]
    # each draft stage is checked against the model as the draft's earlier stages leave it
    bad = [{"kind": "prune", "method": "depth", "num_hidden_layers": 5}, DRAFT_STAGES[2]]
    assert any(k.startswith("draft.stages.0") for k in _problems(_cfg(draft={"stages": bad})))


@pytest.mark.slow
@pytest.mark.minutes(2.5)
@pytest.mark.timeout(1200)
def test_a_run_makes_exports_and_checks_its_draft(tmp_path):
    from export.executorch.runner import DRAFT_METHOD, ExecuTorchRunner
    from optimize.generate import generate_from_artifact

    # a pipeline-wide gate the draft would fail by far: it does not apply to the draft's rows
    cfg = load_config(_cfg(gates={"top1_agreement": {"threshold": 0.1}}))
    report = run_pipeline(cfg, output_dir=tmp_path / "run")
    assert report.ok, [r.gates for r in report.rows]
    names = [r.name for r in report.rows]
    assert names == ["baseline", "0:ptq_int8", "draft:0:prune", "draft:1:distill", "draft:2:ptq_int8",
                     "export:executorch"]
    rows = {r.name: r for r in report.rows}
    assert rows["draft:0:prune"].metrics.top1_agreement < 0.1 and rows["draft:0:prune"].status == "pass"
    export = rows["export:executorch"]
    drafted = export.details["llm_ops"]["draft_method"]
    assert drafted["method"] == DRAFT_METHOD and drafted["layers"] == 1 and drafted["vocab"] == 4096
    # the frozen embedding table is the target's: stored once; the draft's own bytes are its block and head
    assert drafted["shared_bytes"] >= 49152 * 64 and 0 < drafted["own_bytes"] < drafted["shared_bytes"]
    spec = export.details["speculative"]
    assert spec["match"] and spec["draft"]["match"] and spec["draft"]["draft_calls"] > 0
    assert "draft model (method `draft`): 1 layers" in (tmp_path / "run" / "report.md").read_text()

    pte = export.artifact
    runner = ExecuTorchRunner(pte)
    assert len(runner.draft_vocab) == 4096 and {DRAFT_METHOD, "verify", "forward"} <= set(runner.describe()["methods"])
    prompt = "def quote(s):\n    return s\n\ndef quote(s):\n"
    plain = generate_from_artifact(pte, prompt, max_new_tokens=24, runner="python", stream=None, say=None)
    lines = []
    fast = generate_from_artifact(pte, prompt, max_new_tokens=24, stream=None, say=lines.append, speculative="draft")
    assert fast == plain and lines and lines[0].startswith("[speculative draft]") and "draft model calls" in lines[0]

    # a re-run resumes the draft's rows and reuses the export
    again = run_pipeline(load_config(_cfg(gates={"top1_agreement": {"threshold": 0.1}})), output_dir=tmp_path / "run")
    assert again.ok and [r.status for r in again.rows if r.name.startswith("draft:")] == ["resumed"] * 3
    assert json.loads((tmp_path / "run" / "report.json").read_text())["rows"][-1]["details"]["llm_ops"]["draft_method"]


def test_draft_vocabulary_keeps_special_tokens_then_the_most_frequent_then_the_lowest_ids():
    from export.base import ExportError
    from export.executorch.draft import vocabulary

    counts = torch.zeros(100, dtype=torch.long)
    counts[[50, 60, 70]] = torch.tensor([5, 9, 1])
    assert vocabulary(counts, 100, 6, keep=[99]) == [0, 1, 50, 60, 70, 99]
    assert vocabulary(None, 100, 3) == [0, 1, 2]
    with pytest.raises(ExportError, match="between 1 and"):
        vocabulary(counts, 100, 101)
    with pytest.raises(ExportError, match="special tokens"):
        vocabulary(counts, 100, 1, keep=[3, 4])


def test_a_partial_head_keeps_each_rows_integers():
    """rows_of takes a quantized head's rows as they are (data, scales, zero points), so the draft's
    restricted head computes the logits the full head gives for those tokens (up to the matmul's
    float order, which depends on its width here in eager torch)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, quantize_

    from export.executorch.draft import restrict_head
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              lambda m, fqn: fqn == "lm_head")
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        full = model(ids).logits
    keep = [0, 7, 42, 299]
    w = model.lm_head.weight
    restrict_head(model, keep)
    with torch.no_grad():
        part = model(ids).logits
    v = model.lm_head.weight
    assert type(v) is type(w) and v.shape == (4, 64)
    for name in w.tensor_data_names:
        assert torch.equal(getattr(v, name), getattr(w, name)[keep]), name
    assert torch.allclose(part, full[..., keep], atol=1e-5, rtol=0)
    assert model.config.vocab_size == 300 and model.get_input_embeddings().num_embeddings == 300
