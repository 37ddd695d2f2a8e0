"""The parallel layouts on 4 gloo processes (torchrun) against one process on the same data:
each run's loss over 6 steps equals the single-process loss (fp32, within 1e-5 relative), and a
checkpoint saved under dp_shard 2 x tp 2 resumes under dp_shard 4 with the same losses.

The global batch is the same in every pair (8 windows of 64 tokens per step; 16 for the MoE):
the ranks that read different data are the data-parallel ones, and their windows together are
the single process's, so the losses differ by float rounding only."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import TINY_CONFIGS

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]

#: fp32, the same windows; only the order of reductions differs
REL = 1e-5
#: two warm-up steps, a checkpoint at RESUME_AT and as many steps again after it
STEPS = 6
RESUME_AT = 3


def _recipe(th, tmp_path, name: str, arch: str = "llama", tied: bool = True, **train):
    """A tiny-model recipe; ``tied=False`` unties the head (a pipeline puts it on another stage)."""
    out = tmp_path / name
    fields = dict(max_steps=STEPS, checkpoint=dict(every_n_steps=0, save_final=False, export_hf=False))
    fields.update(train)
    recipe = th.tiny_recipe(out, **fields)
    recipe["model"]["config"] = dict(TINY_CONFIGS[arch], tie_word_embeddings=tied)
    return th.write_recipe(tmp_path / f"{name}.yaml", recipe)


def _losses(proc) -> dict[str, float]:
    return json.loads(proc.stdout)["losses"]


def _single(recipe) -> dict[str, float]:
    """The one-process reference, trained in this process (``python -m train``'s launch is what the
    torchrun runs beside it prove; an interpreter start per reference is not)."""
    from train.api import run_training
    from train.recipe import load_recipe

    return run_training(load_recipe(recipe)).model_dump(mode="json")["losses"]


def _assert_equal(got: dict, ref: dict, steps) -> None:
    for s in steps:
        assert abs(got[str(s)] - ref[str(s)]) <= REL * abs(ref[str(s)]), (s, got, ref)


@pytest.mark.minutes(1)
def test_dp_by_tp_equals_one_process_and_resumes_as_dp4(th, tmp_path):
    single = _single(_recipe(th, tmp_path, "single", batch=dict(micro_batch_size=2, grad_accum_steps=4)))
    tp = _recipe(th, tmp_path, "tp", distributed=dict(fsdp=True), parallel=dict(tp=2),
                 memory=dict(activation_checkpointing="selective"),  # recomputes exactly: the losses stay equal
                 compile=True,  # per-block torch.compile over DTensor blocks, torchtitan's composition
                 checkpoint=dict(every_n_steps=RESUME_AT, save_final=False, export_hf=True))
    proc = th.run_train(tp, nproc=4)
    report = json.loads(proc.stdout)
    assert report["parallel"] == {"dp_shard": 2, "tp": 2, "pp": 1, "ep": 1} and report["world_size"] == 4
    assert "parallel layout: dp_shard 2 x tp 2 x pp 1 x ep 1 = 4 ranks" in proc.stderr
    _assert_equal(report["losses"], single, range(1, STEPS + 1))
    assert (tmp_path / "tp" / "hf" / "model.safetensors").is_file()

    # the step-RESUME_AT checkpoint of the tp 2 run, resumed by 4 data-parallel ranks (same global batch)
    resumed = tmp_path / "dp4"
    shutil.copytree(tmp_path / "tp" / "checkpoints", resumed / "checkpoints")
    dp4 = _recipe(th, tmp_path, "dp4", distributed=dict(fsdp=True), batch=dict(micro_batch_size=2, grad_accum_steps=1))
    again = json.loads(th.run_train(dp4, nproc=4).stdout)
    assert again["start_step"] == RESUME_AT and again["parallel"] == {}
    _assert_equal(again["losses"], report["losses"], range(RESUME_AT + 1, STEPS + 1))


@pytest.mark.minutes(1)
def test_pp_by_dp_equals_one_process_under_1f1b_and_gpipe(th, tmp_path):
    """1F1B with the chunked loss computed inside the last stage; GPipe with full logits."""
    single = _single(_recipe(th, tmp_path, "single", tied=False, batch=dict(micro_batch_size=2, grad_accum_steps=4)))
    pp = _recipe(th, tmp_path, "pp", tied=False, distributed=dict(fsdp=True), parallel=dict(pp=2),
                 checkpoint=dict(every_n_steps=0, save_final=False, export_hf=True))
    report = json.loads(th.run_train(pp, nproc=4).stdout)
    assert report["parallel"] == {"dp_shard": 2, "tp": 1, "pp": 2, "ep": 1} and "chunked" in report["loss"]
    _assert_equal(report["losses"], single, range(1, STEPS + 1))
    exported = json.loads((tmp_path / "pp" / "hf" / "config.json").read_text())
    assert exported["num_hidden_layers"] == 2  # rank 0 wrote the whole model, both stages gathered
    from safetensors import safe_open

    with safe_open(tmp_path / "pp" / "hf" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= keys
    assert any(k.startswith("model.layers.1.") for k in keys) and any(k.startswith("model.layers.0.") for k in keys)

    gpipe = _recipe(th, tmp_path, "gpipe", tied=False, parallel=dict(pp=2, pp_schedule="gpipe"),
                    batch=dict(micro_batch_size=2, grad_accum_steps=4), loss=dict(chunked=False))
    _assert_equal(_losses(th.run_train(gpipe, nproc=2)), single, range(1, STEPS + 1))


@pytest.mark.minutes(1)
def test_experts_split_over_ep_equal_one_process(th, tmp_path):
    """ep 2 x dp_shard 4 (experts further sharded by FSDP2 over dp_mod_ep 2), full training; and ep 2
    on 2 ranks (dp_mod_ep 1: the experts stay whole on their rank) with LoRA on the attention."""
    single = _single(_recipe(th, tmp_path, "single", "mixtral", tied=False,
                             batch=dict(micro_batch_size=2, grad_accum_steps=8)))
    ep = _recipe(th, tmp_path, "ep", "mixtral", tied=False, distributed=dict(fsdp=True), parallel=dict(ep=2),
                 memory=dict(activation_checkpointing="full"))  # the experts' collectives rerun in backward
    report = json.loads(th.run_train(ep, nproc=4).stdout)
    assert report["parallel"] == {"dp_shard": 4, "tp": 1, "pp": 1, "ep": 2}
    _assert_equal(report["losses"], single, range(1, STEPS + 1))

    lora = dict(lora=dict(enabled=True), optimizer=dict(lr=1e-2))
    single_lora = _single(_recipe(th, tmp_path, "single_lora", "mixtral", tied=False,
                                  batch=dict(micro_batch_size=2, grad_accum_steps=4), **lora))
    ep_lora = _recipe(th, tmp_path, "ep_lora", "mixtral", tied=False, distributed=dict(fsdp=True),
                      parallel=dict(ep=2), **lora)
    report = json.loads(th.run_train(ep_lora, nproc=2).stdout)
    assert report["trainable_params"] < report["total_params"] / 100
    _assert_equal(report["losses"], single_lora, range(1, STEPS + 1))
