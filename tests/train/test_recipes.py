"""Every example recipe validates; limited_hardware.yaml and long_sequences.yaml run as they are
(multi_gpu.yaml runs in test_fsdp.py)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # the recipe as shipped, in a child process (about 14 s)
@pytest.mark.timeout(300)
def test_limited_hardware_recipe_runs_as_is(tmp_path, th):
    out = tmp_path / "limited"
    proc = th.run_train(th.REPO / "examples/train/limited_hardware.yaml", [f"train.output_dir={out}"])
    report = json.loads(proc.stdout)
    assert report["final_step"] == 6 and report["grad_accum_steps"] == 4
    assert report["trainable_params"] < report["total_params"] / 50  # adapters only
    assert "QLoRA: 14 base weights stored as NF4" in proc.stderr
    assert "activation checkpointing (full) on 2 blocks" in proc.stderr
    assert (out / "metrics.csv").read_text().count("\n") == 7  # header + 6 steps
    assert (out / "hf" / "config.json").is_file()


def test_every_example_validates(th):
    from train.recipe import load_recipe

    names = sorted(p.name for p in (th.REPO / "examples/train").glob("*.yaml"))
    assert {"limited_hardware.yaml", "long_sequences.yaml", "multi_gpu.yaml"} <= set(names)
    for name in names:
        load_recipe(th.REPO / "examples/train" / name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_long_sequences_recipe_runs_as_is(long_sequences_run):
    report, stderr, out = long_sequences_run
    assert report["final_step"] == 12
    assert report["seq_lens"] == {str(s): 128 if s <= 4 else 256 if s <= 8 else 512 for s in range(1, 13)}
    assert report["attention_kernel"] == "sdpa:flash"  # observed: SDPA's CPU flash kernel ran every block
    att = report["attention"]
    assert (att["window_mode"], att["sliding_window"], att["global_tokens"]) == ("blockwise", 128, 4)
    # 2 layers x (512 / 128) query blocks: the band is computed block by block, never as a [T, T] mask
    assert att["kernel_calls_by_seq_len"]["512"] == {"sdpa:flash": 8}
    assert report["loss"] == "cross-entropy, chunked (256 tokens per chunk)"
    assert "activation checkpointing (full) on 2 blocks" in stderr
    assert "length curriculum: 128 until step 4, 256 until step 8, 512 after" in stderr
    assert "attention at seq_len 512: sdpa:flash x8 per forward" in stderr
    assert report["final_loss"] < report["first_loss"] - 0.5
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].endswith(",seq_len") and rows[-1].endswith(",512") and len(rows) == 13
    assert (out / "hf" / "model.safetensors").is_file()
