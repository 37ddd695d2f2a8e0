"""The loop with long-sequence options: activation checkpointing composes with windows, the sparse
pattern, the chunked loss and the curriculum; the curriculum packs without padding and resumes
mid-stage and at a stage boundary; bad options are refused with messages that name them."""

from __future__ import annotations

import copy
import json
import logging
import shutil

import pytest
import torch
from pydantic import ValidationError

from train.config import CurriculumStage, LoopConfig, LossConfig
from train.curriculum import LengthSchedule, StagedBatches
from train.loop import train
from train.recipe import RecipeError, parse_recipe

CURRICULUM = [dict(until_step=2, seq_len=32), dict(until_step=4, seq_len=48)]


def _cfg(tmp_path, name: str, **kw) -> LoopConfig:
    base = dict(
        output_dir=tmp_path / name,
        max_steps=5,
        optimizer=dict(lr=2e-3),
        batch=dict(micro_batch_size=2, grad_accum_steps=2),
        checkpoint=dict(save_final=False, export_hf=False),
        logging=dict(progress_bar=False, csv=False),
    )
    base.update(kw)
    return LoopConfig(**base)


def _run(model, ids, cfg):
    return train(copy.deepcopy(model), ids, cfg, seq_len=64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention",
    [
        dict(sliding_window=24, global_tokens=4),  # blockwise on SDPA's flash kernel
        dict(sliding_window=24, global_tokens=4, window_impl="mask", sdpa_kernel="math"),
    ],
    ids=["blockwise", "mask-math"],
)
def test_checkpointing_composes_with_window_sparse_chunked_loss_and_curriculum(tiny_llama, train_ids, tmp_path, attention):
    kw = dict(attention=attention, loss=dict(chunk_size=40), curriculum=CURRICULUM)
    plain = _run(tiny_llama, train_ids, _cfg(tmp_path, "plain", **kw))
    assert plain.seq_lens == {1: 32, 2: 32, 3: 48, 4: 48, 5: 64}
    for mode in ("full", "selective"):
        ckpt = _run(tiny_llama, train_ids, _cfg(tmp_path, mode, memory=dict(activation_checkpointing=mode), **kw))
        for step, loss in plain.losses.items():
            assert ckpt.losses[step] == pytest.approx(loss, abs=1e-6), (mode, step)
    full_attention = _run(tiny_llama, train_ids, _cfg(tmp_path, "dense", curriculum=CURRICULUM))
    assert abs(full_attention.losses[5] - plain.losses[5]) > 1e-4  # the pattern did change training


def test_chunked_loss_in_the_loop_equals_full_logits(tiny_llama, train_ids, tmp_path):
    chunked = _run(tiny_llama, train_ids, _cfg(tmp_path, "chunked", max_steps=3, loss=dict(chunk_size=50)))
    full = _run(tiny_llama, train_ids, _cfg(tmp_path, "full", max_steps=3, loss=dict(chunked=False)))
    assert chunked.loss == "cross-entropy, chunked (50 tokens per chunk)"
    assert full.loss == "cross-entropy, full fp32 logits"
    for step in full.losses:
        assert chunked.losses[step] == pytest.approx(full.losses[step], abs=2e-5)


def test_the_kernel_that_ran_is_logged_and_reported(tiny_llama, train_ids, tmp_path, caplog):
    attention = dict(backend="sdpa", sdpa_kernel="math", sliding_window=24, window_impl="mask")
    with caplog.at_level(logging.INFO, logger="optimize.train"):
        res = _run(tiny_llama, train_ids, _cfg(tmp_path, "math", max_steps=3, attention=attention, curriculum=CURRICULUM[:1]))
    assert res.attention["kernel"] == "sdpa:math"
    assert res.attention["kernel_calls_by_seq_len"] == {32: {"sdpa:math": 2}, 64: {"sdpa:math": 2}}
    assert "attention at seq_len 64: sdpa:math x2 per forward (implementation sdpa, sdpa_kernel math, mask window 24)" in caplog.text
    assert res.model.config._attn_implementation == "sdpa"  # the pattern is undone after training


def test_curriculum_packs_the_stream_without_padding():
    n = 1000
    schedule = LengthSchedule([CurriculumStage(until_step=2, seq_len=8), CurriculumStage(until_step=4, seq_len=16)], 32)
    staged = StagedBatches(torch.arange(n), schedule, per_rank_batch=3, seed=5)
    for step, length in enumerate([8, 8, 16, 16, 32, 32]):
        batch = staged.next_batch(step)
        x, y = batch["input_ids"], batch["labels"]
        assert x.shape == (3, length) and staged.seq_len == length
        assert torch.equal(y, x + 1)  # labels are the next tokens of one contiguous stretch
        assert bool((x[:, 0] % length == 0).all())  # windows tile the stream at multiples of the length
        assert staged.sampler.n == (n - 1) // length  # every window but the tail's < length tokens
    staged.close()


@pytest.mark.slow
def test_curriculum_resumes_mid_stage_and_at_a_stage_boundary(tiny_llama, train_ids, tmp_path):
    kw = dict(max_steps=7, curriculum=CURRICULUM, checkpoint=dict(every_n_steps=2, keep_last=4, save_final=False,
                                                                   export_hf=False))
    full = _run(tiny_llama, train_ids, _cfg(tmp_path, "full", **kw))
    state = json.loads((tmp_path / "full/checkpoints/step-00000004/trainer_state.json").read_text())
    assert (state["data"]["stage"], state["data"]["seq_len"], state["data"]["position"]) == (1, 48, 2)
    for at in (2, 4):  # step 2 ends stage 0 (its state resumes into stage 1); step 4 ends stage 1 (mid-way above)
        name = f"resumed{at}"
        shutil.copytree(tmp_path / f"full/checkpoints/step-{at:08d}", tmp_path / f"{name}/checkpoints/step-{at:08d}")
        resumed = _run(tiny_llama, train_ids, _cfg(tmp_path, name, **kw))
        assert resumed.start_step == at and sorted(resumed.losses) == list(range(at + 1, 8))
        for step in resumed.losses:
            assert resumed.losses[step] == pytest.approx(full.losses[step], abs=1e-6), (at, step)
            assert resumed.seq_lens[step] == full.seq_lens[step]
    changed = dict(kw, curriculum=[dict(until_step=2, seq_len=32), dict(until_step=6, seq_len=40)])
    shutil.copytree(tmp_path / "full/checkpoints/step-00000004", tmp_path / "changed/checkpoints/step-00000004")
    with pytest.raises(ValueError, match="step 4 was in curriculum stage 1 \\(seq_len 48\\).*resume with the same curr"):
        _run(tiny_llama, train_ids, _cfg(tmp_path, "changed", **changed))


@pytest.mark.parametrize(
    "curriculum,message",
    [
        ([dict(until_step=4, seq_len=64), dict(until_step=8, seq_len=64)], "curriculum stages must grow"),
        ([dict(until_step=4, seq_len=32), dict(until_step=4, seq_len=64)], "until_step 4, seq_len 32\\) then \\(until_step 4"),
        ([dict(until_step=0, seq_len=32)], "curriculum.0.until_step\n  Input should be greater than or equal to 1"),
        ([dict(until_step=2, seq_len=4)], "curriculum.0.seq_len\n  Input should be greater than or equal to 8"),
        ([dict(until_step=2)], "curriculum.0.seq_len\n  Field required"),
    ],
)
def test_bad_curriculum(curriculum, message):
    with pytest.raises(ValidationError, match=message):
        LoopConfig(curriculum=curriculum)


def test_bad_loss_and_device_options():
    with pytest.raises(ValidationError, match="chunk_size\n  Input should be greater than or equal to 16"):
        LossConfig(chunk_size=8)
    with pytest.raises(ValidationError, match="chunked\n  Input should be a valid boolean"):
        LossConfig(chunked="sometimes")
    with pytest.raises(ValidationError, match="flash_attention_2 needs CUDA and device is cpu"):
        LoopConfig(device="cpu", attention=dict(backend="flash_attention_2"))


def test_recipe_checks_the_context(th, tmp_path):
    def recipe(**train):
        r = th.tiny_recipe(tmp_path)
        r["train"].update(train)
        return r

    with pytest.raises(RecipeError, match="<root>: train.curriculum: stage seq_len 64 must be shorter than data.seq_len 64"):
        parse_recipe(recipe(curriculum=[dict(until_step=2, seq_len=64)]))
    with pytest.raises(RecipeError, match="sliding_window 64 must be smaller than the training context data.seq_len 64"):
        parse_recipe(recipe(attention=dict(sliding_window=64)))
    with pytest.raises(RecipeError, match="attention.sdpa_kernel math needs SDPA, but the model's attention is eager"):
        parse_recipe(recipe(attention=dict(sdpa_kernel="math")), overrides=["model.attn_implementation=eager"])
    with pytest.raises(RecipeError, match="model.attn_implementation flash_attention_2 needs CUDA and train.device is cpu"):
        parse_recipe(recipe(device="cpu"), overrides=["model.attn_implementation=flash_attention_2"])
    with pytest.raises(RecipeError, match="train.attention: unknown key 'slidingwindow' \\(did you mean 'sliding_window'\\?\\)"):
        parse_recipe(recipe(attention=dict(slidingwindow=8)))
    loop = parse_recipe(recipe(), overrides=["model.attn_implementation=eager"]).loop_config()
    assert loop.attention.backend == "eager"  # the model's choice reaches the loop
    assert parse_recipe(recipe()).loop_config().attention.backend is None  # the default sdpa: the source applied it


@pytest.mark.slow
def test_recipe_default_attention_keeps_a_family_without_sdpa(tmp_path):
    """Gemma-2 has no SDPA path, so its source loads it eager under the recipe default (sdpa); the
    loop keeps that and a window applies through the mask instead of refusing the recipe."""
    from tests.conftest import TINY_CONFIGS
    from train.attention import configure_attention
    from targets.sources import load_model

    raw = dict(model=dict(source="random", seed=0, config=dict(TINY_CONFIGS["gemma2"])),
               data=dict(seq_len=64), train=dict(device="cpu", attention=dict(sliding_window=16)))
    recipe = parse_recipe(raw)
    model = load_model(recipe.model).model
    setup = configure_attention(model, recipe.loop_config().attention, torch.device("cpu"), torch.float32, 64)
    assert (setup.implementation, setup.mode, setup.window) == ("eager", "mask", 16)


def test_curriculum_needs_a_token_stream(tiny_llama, tmp_path):
    windows = torch.randint(0, 100, (16, 65))
    with pytest.raises(ValueError, match="a length curriculum re-windows the token stream: pass 1-D token ids"):
        _run(tiny_llama, windows, _cfg(tmp_path, "w", curriculum=CURRICULUM))
    with pytest.raises(ValueError, match="stage 0 has seq_len 64; stages must be shorter than the full length 64"):
        LengthSchedule([CurriculumStage(until_step=2, seq_len=64)], 64)
