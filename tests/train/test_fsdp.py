"""FSDP2 on 2 gloo processes (torchrun): learns, saves, resumes exactly; QLoRA with NF4 shards."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]


def test_fsdp2_two_ranks_learns_and_resumes_exactly(tmp_path, th):
    out = tmp_path / "run"
    recipe = th.write_recipe(
        tmp_path / "fsdp.yaml",
        th.tiny_recipe(out, max_steps=8, distributed=dict(fsdp=True), checkpoint=dict(every_n_steps=4, keep_last=3)),
    )
    first = json.loads(th.run_train(recipe, nproc=2).stdout)
    assert first["world_size"] == 2 and first["start_step"] == 0
    losses = [first["losses"][str(s)] for s in range(1, 9)]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses
    assert (out / "hf" / "model.safetensors").is_file()

    # drop the final checkpoint: the next launch resumes from step 4 and must retrace steps 5..8
    shutil.rmtree(out / "checkpoints" / "step-00000008")
    (out / "report.json").unlink()
    again = json.loads(th.run_train(recipe, nproc=2).stdout)
    assert again["start_step"] == 4
    for step in ("5", "6", "7", "8"):
        assert abs(again["losses"][step] - first["losses"][step]) <= 1e-6, step


def test_multi_gpu_recipe_runs_as_is_with_nf4_shards(tmp_path, th):
    """examples/train/multi_gpu.yaml: FSDP2 + bf16 policy + QLoRA NF4 sharded per parameter + DataLoader workers."""
    out = tmp_path / "multi"
    proc = th.run_train(th.REPO / "examples/train/multi_gpu.yaml", [f"train.output_dir={out}"], nproc=2)
    report = json.loads(proc.stdout)
    assert report["world_size"] == 2 and report["final_step"] == 6
    assert report["trainable_params"] < report["total_params"] / 50
    assert "QLoRA: 14 base weights stored as NF4" in proc.stderr
    assert "FSDP2: 14 parameters sharded per-parameter as NF4" in proc.stderr
    assert (out / "hf" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "step-00000006" / "COMPLETE").is_file()
