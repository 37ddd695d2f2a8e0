"""examples/train/limited_hardware.yaml runs as it is (multi_gpu.yaml runs in test_fsdp.py)."""

from __future__ import annotations

import json

import pytest


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
