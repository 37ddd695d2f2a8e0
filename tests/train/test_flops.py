"""Model FLOPs per token, the peak table, MFU, and where they land (metrics.csv, report.json)."""

from __future__ import annotations

import copy
import csv
import json

import pytest
import torch

from train.flops import device_peak, flops_per_token, mfu, model_flops, peak_tflops_for


def _tiny_llama_numbers(tied: bool = True) -> dict:
    """The tiny Llama's parameter count, written out from its config (tests/conftest.py)."""
    hidden, inter, layers, heads, kv, vocab = 64, 128, 2, 4, 2, 49152
    head_dim = hidden // heads
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o and k, v
    per_layer = attn + 3 * hidden * inter + 2 * hidden  # + gate/up/down + two RMSNorms
    blocks = layers * per_layer + hidden  # + the final norm
    emb = vocab * hidden
    return dict(matmul=blocks + emb, layers=layers, width=heads * head_dim, emb=emb, blocks=blocks)


def test_flops_per_token_formula():
    assert flops_per_token(100, 100, 2, 8, 16) == 6 * 100 + 12 * 2 * 8 * 16
    assert flops_per_token(100, 10, 2, 8, 16) == 4 * 100 + 2 * 10 + 12 * 2 * 8 * 16  # frozen base: no weight grads


def test_model_flops_of_a_tied_llama(tiny_llama):
    n = _tiny_llama_numbers()
    f = model_flops(tiny_llama)
    assert (f.matmul_params, f.trained_matmul_params, f.n_layers, f.attn_width) == (n["matmul"], n["matmul"], 2, 64)
    assert f.per_token(64) == 6 * n["matmul"] + 12 * 2 * 64 * 64
    windowed = model_flops(tiny_llama, attention_span=16 + 4)
    assert windowed.per_token(64) == 6 * n["matmul"] + 12 * 2 * 64 * 20  # a query sees window + global keys
    assert windowed.per_token(8) == 6 * n["matmul"] + 12 * 2 * 64 * 8


def test_untied_embedding_is_a_lookup_and_lora_trains_only_adapters(tiny_llama_config):
    from train.config import LoRAConfig
    from train.lora import apply_lora
    from targets.sources import RandomSource, load_model

    untied = load_model(RandomSource(config={**tiny_llama_config, "tie_word_embeddings": False}, seed=0)).model
    n = _tiny_llama_numbers()
    assert model_flops(untied).matmul_params == n["blocks"] + n["emb"]  # the separate head counts, the lookup not

    lora = apply_lora(copy.deepcopy(untied), LoRAConfig(enabled=True, rank=8))
    f = model_flops(lora)
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert f.trained_matmul_params == adapters and f.matmul_params == n["blocks"] + n["emb"] + adapters


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", None),  # not the A10: unknown rather than wrong
        ("Tesla V100-SXM2-16GB", None),  # no bf16 tensor cores
    ],
)
def test_peak_table_by_device_name(name, tflops):
    assert peak_tflops_for(name) == tflops


def test_cpu_has_no_peak_unless_configured():
    peak = device_peak(torch.device("cpu"))
    assert peak.tflops is None and peak.source == "unknown" and peak.device_name == "cpu"
    assert device_peak(torch.device("cpu"), 2.5).tflops == 2.5
    assert mfu(1e12, 2.0, None) is None
    assert mfu(1e12, 2.0, 1.0) == pytest.approx(0.5)
    assert mfu(1e12, 2.0, 1.0, world=2) == pytest.approx(0.25)


def _loop_cfg(tmp_path, name, **logging):
    from train.config import LoopConfig

    return LoopConfig(
        output_dir=tmp_path / name,
        max_steps=4,
        optimizer=dict(lr=2e-3),
        batch=dict(micro_batch_size=2, grad_accum_steps=1),
        checkpoint=dict(save_final=False, export_hf=False),
        logging=dict(progress_bar=False, csv=True, every_n_steps=2, **logging),
    )


def test_metrics_csv_has_tokens_per_s_and_mfu(tiny_llama, train_ids, tmp_path):
    from train.loop import train

    res = train(copy.deepcopy(tiny_llama), train_ids, _loop_cfg(tmp_path, "peak", peak_tflops=0.5), seq_len=64)
    rows = list(csv.DictReader(open(tmp_path / "peak/metrics.csv")))
    assert [int(r["step"]) for r in rows] == [2, 4]  # every_n_steps
    fpt = model_flops(res.model).per_token(64)
    for r in rows:
        assert float(r["tokens_per_s"]) > 0
        assert float(r["mfu"]) == pytest.approx(float(r["tokens_per_s"]) * fpt / 0.5e12, rel=1e-6)
        assert float(r["loss"]) == pytest.approx(res.losses[int(r["step"])])
    assert res.flops_per_token == fpt and res.peak_tflops == 0.5
    assert res.steady_tokens_per_s > 0 and res.mfu == pytest.approx(res.steady_tokens_per_s * fpt / 0.5e12, rel=1e-6)
    assert sorted(res.losses) == [1, 2, 3, 4]  # every step's loss, read back at the intervals

    plain = train(copy.deepcopy(tiny_llama), train_ids, _loop_cfg(tmp_path, "cpu"), seq_len=64)
    rows = list(csv.DictReader(open(tmp_path / "cpu/metrics.csv")))
    assert all(r["mfu"] == "" for r in rows) and plain.mfu is None and plain.device_name == "cpu"


def test_report_json_has_throughput_and_mfu(tmp_path, th):
    from train.api import run_training
    from train.recipe import parse_recipe

    recipe = th.tiny_recipe(tmp_path / "run", max_steps=3, checkpoint=dict(save_final=False, export_hf=False),
                            logging=dict(progress_bar=False, peak_tflops=1.0))
    returned = run_training(parse_recipe(recipe))
    report = json.loads((tmp_path / "run/report.json").read_text())
    assert report == returned.model_dump(mode="json")
    for key in ("tokens_per_s", "steady_tokens_per_s", "mfu", "flops_per_token", "peak_tflops", "device_name"):
        assert key in report, key
    assert report["tokens_per_s"] > 0 and report["steady_tokens_per_s"] > 0
    n = _tiny_llama_numbers()
    assert report["flops_per_token"] == flops_per_token(n["matmul"], n["matmul"], n["layers"], n["width"], 64)
    assert report["mfu"] == pytest.approx(report["steady_tokens_per_s"] * report["flops_per_token"] / 1e12, rel=1e-6)
    assert report["device_name"] == "cpu" and report["compiled_blocks"] == 0
