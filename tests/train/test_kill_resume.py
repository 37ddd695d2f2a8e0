"""SIGKILL a training run part-way (also mid-way through a length curriculum); the automatic
resume continues bit-for-bit (1e-6 on CPU)."""

from __future__ import annotations

import json
import signal
import time

import pytest


def _wait_for(path, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before {path} appeared:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)


@pytest.mark.slow  # two training processes, one killed (about 27 s)
@pytest.mark.timeout(420)
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, th):
    steps = 14
    ckpt = dict(every_n_steps=2, keep_last=3)
    killed_dir, ref_dir = tmp_path / "killed", tmp_path / "ref"
    killed = th.write_recipe(tmp_path / "killed.yaml", th.tiny_recipe(killed_dir, max_steps=steps, checkpoint=ckpt))
    ref = th.write_recipe(tmp_path / "ref.yaml", th.tiny_recipe(ref_dir, max_steps=steps, checkpoint=ckpt))

    proc = th.popen_train(killed)
    try:
        _wait_for(killed_dir / "checkpoints" / "step-00000004" / "COMPLETE", proc, timeout=240)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed_dir / "report.json").exists(), "the run finished before the kill; nothing was tested"
    assert not (killed_dir / "checkpoints" / f"step-{steps:08d}").exists()

    resumed = json.loads(th.run_train(killed).stdout)
    start = resumed["start_step"]
    assert start >= 4 and resumed["resumed_from"].endswith(f"step-{start:08d}")
    assert sorted(map(int, resumed["losses"])) == list(range(start + 1, steps + 1))

    uninterrupted = json.loads(th.run_train(ref).stdout)
    assert uninterrupted["start_step"] == 0
    for step, loss in resumed["losses"].items():
        assert abs(loss - uninterrupted["losses"][step]) <= 1e-6, (step, loss, uninterrupted["losses"][step])
    assert uninterrupted["final_loss"] < uninterrupted["first_loss"]
    # the resumed run also exported the consolidated model
    assert (killed_dir / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.minutes(1.2)
@pytest.mark.timeout(420)
def test_sigkill_mid_curriculum_then_resume_matches_uninterrupted(tmp_path, th, long_sequences_run):
    """examples/train/long_sequences.yaml (window, global tokens, chunked loss, checkpointing,
    curriculum 128 -> 256 -> 512) killed in its second stage resumes there, on the same windows."""
    reference, _, _ = long_sequences_run
    out = tmp_path / "killed"
    recipe = th.REPO / "examples/train/long_sequences.yaml"
    overrides = [f"train.output_dir={out}", "train.checkpoint.every_n_steps=2", "train.checkpoint.keep_last=3",
                 "train.checkpoint.export_hf=false", "train.logging.progress_bar=false"]
    proc = th.popen_train(recipe, overrides)
    try:
        _wait_for(out / "checkpoints" / "step-00000006" / "COMPLETE", proc, timeout=240)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "report.json").exists(), "the run finished before the kill; nothing was tested"
    state = json.loads((out / "checkpoints/step-00000006/trainer_state.json").read_text())
    assert (state["data"]["stage"], state["data"]["seq_len"]) == (1, 256)  # mid-way through stage 1

    resumed = json.loads(th.run_train(recipe, overrides).stdout)
    start = resumed["start_step"]
    assert 6 <= start < 12 and sorted(map(int, resumed["losses"])) == list(range(start + 1, 13))
    for step, loss in resumed["losses"].items():
        assert abs(loss - reference["losses"][step]) <= 1e-6, (step, loss, reference["losses"][step])
        assert resumed["seq_lens"][step] == reference["seq_lens"][step]
