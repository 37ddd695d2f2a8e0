"""bench/gpu.py: what it runs on a GPU, and the tables it prints (the GPU runs themselves need CUDA)."""

from __future__ import annotations

import argparse

import pytest

from tests.bench.conftest import load_bench_script


@pytest.fixture(scope="module")
def gpu():
    yield from load_bench_script("gpu")


def test_every_recipe_runs_with_every_sdpa_kernel_and_flex_attention(gpu):
    args = argparse.Namespace(tokenizer="tok", device="cuda", smoke=False)
    runs = gpu._recipe_runs(args)
    recipes = sorted(p.stem for p in (gpu.REPO / "examples" / "train").glob("*.yaml"))
    assert len(recipes) >= 3
    labels = {label for label, _, _ in runs}
    for recipe in recipes:
        for kernel in gpu.SDPA_KERNELS:
            assert f"{recipe} / sdpa {kernel}" in labels
        assert f"{recipe} / flex_attention" in labels
    for label, launcher, over in runs:
        assert "train.device=cuda" in over and "train.precision.mode=bf16" in over and "model.tokenizer=tok" in over
        # multi_gpu goes through torchrun with one process, as the issue asks
        assert ("torch.distributed.run" in launcher) == label.startswith("multi_gpu")
        if label.startswith("multi_gpu"):
            assert launcher[launcher.index("--nproc_per_node") + 1] == "1"


def test_tables_show_ratios_failures_and_the_stage_speedup(gpu):
    results = {
        "device": "NVIDIA H200", "budget_s": 480, "wall_s": 400,
        "throughput": [
            {"shape": "s", "micro_batch": 8, "seq": 2048, "variant": "plain loop + torch.compile", "tok_s": 100.0,
             "mfu": 0.3, "peak_mib": 2048, "first_step_s": 60},
            {"shape": "s", "micro_batch": 8, "seq": 2048, "variant": "trainer (train.compile)", "tok_s": 130.0,
             "mfu": 0.39, "peak_mib": 1024, "compiled_blocks": 32, "loss": "chunked"},
        ],
        "mfu": [{"shape": "b", "micro_batch": 4, "seq": 2048, "variant": "trainer (train.compile)",
                 "error": "skipped: the run's time budget is spent"}],
        "recipes": [{"run": "multi_gpu / resume from step 6", "resumed": True, "steps": "6->8", "tok_s": 10.0},
                    {"run": "multi_gpu / sdpa efficient", "error": "exit 2: error: efficient cannot run"}],
        "stages_summary": {"gpu_s": 10.0, "cpu_s": 100.0, "cpu_note": "finished", "speedup": 10.0, "gpu_ppl": 15.0,
                           "cpu_ppl": 15.1, "ppl_diff_pct": -0.66},
    }
    text = gpu.tables(results)
    assert "| s | 8 x 2048 | trainer (train.compile) | 130 | 39.0% | 1.0 | 1.30 |" in text
    assert "| b | 4 x 2048 | trainer (train.compile) | failed: skipped: the run's time budget is spent" in text
    assert "| multi_gpu / resume from step 6 | resumed | 6->8 |" in text
    assert "| multi_gpu / sdpa efficient | failed: exit 2: error: efficient cannot run |" in text
    assert "**10.0x**" in text and "(-0.66%)" in text


def test_the_stage_speedup_is_taken_over_the_stages_not_the_baseline(gpu):
    rows = [{"run": "r", "stage": "baseline", "wall_s": 50.0, "perplexity": 9.0},
            {"run": "r", "stage": "0:awq", "wall_s": 2.0, "perplexity": 9.0},
            {"run": "r", "stage": "1:ptq_int8", "wall_s": 3.0, "perplexity": 9.5},
            {"run": "r", "error": "ignored"}]
    assert gpu._stage_seconds(rows) == (5.0, 9.5)
    assert gpu._stage_seconds([{"run": "r", "error": "x"}]) == (None, None)


def test_without_cuda_it_asks_for_a_gpu_or_smoke(gpu, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as err:
        gpu.main(["--sections", "throughput"])
    assert err.value.code == 2 and "--smoke" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["--sections", "nope", "--smoke"])
    assert "unknown nope" in capsys.readouterr().err
