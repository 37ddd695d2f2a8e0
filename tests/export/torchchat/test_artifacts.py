"""TorchChat target end to end: one pipeline run (tiny Llama, a gqa rewrite, ``target: torchchat``)
builds model.pth, model.pte and model.pt2 once; the tests check the three report rows, parity
of each runtime, the metadata torchchat's runners read, and that the .pt2 answers torchchat's
own call (int32 tokens, one token at a time)."""

from __future__ import annotations

import json

import pytest
import torch

from export.torchchat.aoti import AOTIRunner
from export.executorch.runner import ExecuTorchRunner
from export.torchchat.meta_llama import MetaLlamaRunner

MAX_SEQ_LEN = 80
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, tie_word_embeddings=True,
            rope_theta=100000.0, initializer_range=0.2)

# one ExecuTorch lowering and one AOTInductor compile: about 1.5 min on 2 free cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from optimize import load_config, run_pipeline

    out = tmp_path_factory.mktemp("torchchat_run")
    cfg = {
        "version": 1, "name": "tiny-torchchat", "target": "torchchat", "output_dir": str(out / "run"),
        "model": {"source": "random", "config": dict(TINY)},
        "data": {"eval_tokens": 256, "calibration_tokens": 128, "seq_len": 64},
        "checks": {"latency": {"runs": 1, "warmup": 0, "decode_tokens": 4, "prompt_tokens": 16, "threads": 1},
                   "generate_tokens": 8, "memory": False},  # the peak-RSS children: tests/optimize/test_memory.py
        "stages": [{"kind": "gqa", "num_key_value_heads": 1}],  # Llama-compatible after the rewrite too
        "export": {"torchchat": {"max_seq_len": MAX_SEQ_LEN}},
    }
    report = run_pipeline(load_config(cfg), say=lambda m: None)
    return report, out / "run" / "export" / "torchchat"


def test_three_rows_with_accuracy_size_and_latency(run):
    report, _ = run
    assert report.ok, report.stopped_at
    rows = {r.name: r for r in report.rows if r.name.startswith("export:torchchat")}
    assert set(rows) == {"export:torchchat", "export:torchchat:pte", "export:torchchat:pt2"}
    runtimes = {name: r.runtime for name, r in rows.items()}
    assert runtimes == {"export:torchchat": "torchchat-pth", "export:torchchat:pte": "executorch",
                        "export:torchchat:pt2": "aoti"}
    stage = next(r for r in report.rows if r.kind == "gqa").metrics  # the model that was exported
    for name, row in rows.items():
        m = row.metrics
        assert m.size_mb > 1 and m.prefill_ms > 0 and m.decode_tok_s > 0, name
        # perplexity and agreement are measured against the baseline, as for the stage rows
        assert abs(m.perplexity / stage.perplexity - 1) < 1e-3, (name, m.perplexity, stage.perplexity)
        assert abs(m.top1_agreement - stage.top1_agreement) <= 0.02, (name, m.top1_agreement, stage.top1_agreement)
        assert row.details["greedy"]["match"], name
        tol = 1e-4 if name == "export:torchchat" else 1e-3
        assert row.details["parity_vs_eager"]["max_abs_diff"] <= tol, (name, row.details["parity_vs_eager"])
    assert rows["export:torchchat"].details["probe"]["max_abs_diff"] <= 1e-4


def test_pt2_matches_the_pth_over_the_whole_context(run):
    """A full-length prefill, then prefill + single-token decode, agree with the verified .pth."""
    _, out = run
    pt2, ref = AOTIRunner(out / "model.pt2"), MetaLlamaRunner(out / "model.pth")
    assert pt2.max_seq_len == ref.max_seq_len == MAX_SEQ_LEN
    ids = torch.randint(0, 49152, (MAX_SEQ_LEN,), generator=torch.Generator().manual_seed(2))
    assert (pt2.forward(ids) - ref.forward(ids)).abs().max() <= 1e-3
    pt2.reset(), ref.reset()
    a = torch.cat([pt2.forward(ids[:20])] + [pt2.forward(ids[i:i + 1]) for i in range(20, 30)])
    b = ref.forward(ids[:30])
    assert (a - b).abs().max() <= 1e-3
    with pytest.raises(Exception, match="exceed max_seq_len"):
        pt2.forward(ids[: MAX_SEQ_LEN - 29])


def test_pt2_answers_torchchats_own_call(run):
    """torchchat's generate: aoti_load_package, then model(int32 [1, 1], int32 [1]) per token."""
    _, out = run
    model = torch._inductor.aoti_load_package(str(out / "model.pt2"))
    meta = model.get_metadata()
    assert meta["tokenizer_type"] == "3" and meta["AOTI_DEVICE_KEY"] == "cpu"
    ids = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(3)).int()
    with torch.inference_mode():
        logits = [model(ids[i].view(1, 1), torch.tensor([i], dtype=torch.int32)) for i in range(12)]
    assert logits[0].shape == (1, 1, 49152)
    ref = MetaLlamaRunner(out / "model.pth").forward(ids.long())
    assert (torch.cat([x[0] for x in logits]) - ref).abs().max() <= 1e-3


def test_pte_metadata_is_what_torchchats_runner_reads(run):
    _, out = run
    meta = ExecuTorchRunner(out / "model.pte").meta
    params = json.loads((out / "params.json").read_text())
    assert meta["tokenizer_type"] == 3  # BPE tokenizer.json
    assert meta["get_max_seq_len"] == params["max_seq_length"] == MAX_SEQ_LEN
    assert meta["get_vocab_size"] == params["vocab_size"] == 49152
    assert meta["get_bos_id"] == 1 and meta["get_eos_ids"] == [2]
    assert params["n_kv_heads"] == 1  # the gqa stage's rewrite is what was exported


def test_run_md_names_every_file_with_its_flag(run):
    _, out = run
    text = (out / "RUN.md").read_text()
    for flag, name in (("--checkpoint-path", "model.pth"), ("--params-path", "params.json"),
                       ("--tokenizer-path", "tokenizer.json"), ("--pte-path", "model.pte"),
                       ("--aoti-package-path", "model.pt2")):
        assert f"{flag} $M/{name}" in text and (out / name).is_file(), flag
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) >= {"model.pth", "params.json", "tokenizer.json", "model.pte", "model.pt2"}
