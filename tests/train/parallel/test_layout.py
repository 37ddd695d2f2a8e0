"""The layout checks: sizes against the world, the model against each split, the config's own
conflicts, and ``python -m train --check`` (no weights, no ranks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError
from transformers import AutoConfig

from tests.conftest import TINY_CONFIGS
from train.config import LoopConfig, ParallelConfig
from train.errors import TrainInputError
from train.parallel.layout import Layout, check_model, num_experts, resolve


def _config(arch: str, **over):
    kw = {**TINY_CONFIGS[arch], **over}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _refusal(layout: Layout, arch: str, seq_lens=(64,), par: ParallelConfig | None = None, **over) -> str:
    with pytest.raises(TrainInputError) as err:
        check_model(layout, _config(arch, **over), list(seq_lens), par or ParallelConfig())
    return str(err.value)


def test_auto_data_parallel_fills_the_world():
    assert resolve(ParallelConfig(tp=2), 8) == Layout(dp_shard=4, tp=2)
    assert resolve(ParallelConfig(tp=2, pp=2, dp_shard="auto"), 4) == Layout(dp_shard=1, tp=2, pp=2)
    assert resolve(ParallelConfig(ep=2), 4) == Layout(dp_shard=4, ep=2)


@pytest.mark.parametrize("par, world, words", [
    (ParallelConfig(tp=2, pp=2), 6, "does not divide the world size 6"),
    (ParallelConfig(dp_shard=2, tp=2), 8, "= 4, but the world size is 8"),
    (ParallelConfig(ep=4), 2, "must divide it"),
])
def test_sizes_that_do_not_fit_the_world_are_refused(par, world, words):
    with pytest.raises(TrainInputError, match=words):
        resolve(par, world)


def test_data_parallel_ranks_need_fsdp():
    with pytest.raises(TrainInputError, match="set distributed.fsdp: true"):
        resolve(ParallelConfig(tp=2), 4, fsdp=False)
    assert resolve(ParallelConfig(tp=2), 2, fsdp=False) == Layout(tp=2)  # no data-parallel ranks: no FSDP


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_llama_family_blocks_take_tensor_parallelism(arch):
    check_model(Layout(dp_shard=1, tp=2), _config(arch), [64], ParallelConfig(tp=2))


@pytest.mark.parametrize("arch, words", [
    ("phi3", "fused qkv_proj"),
    ("gpt2", "Conv1D"),
    ("mixtral", "split its experts with ep"),
])
def test_families_tensor_parallelism_cannot_split_are_refused_with_the_reason(arch, words):
    assert words in _refusal(Layout(tp=2), arch)


def test_tensor_parallel_sizes_must_divide_heads_kv_heads_and_mlp():
    assert "num_attention_heads 4" in _refusal(Layout(tp=8), "llama")
    assert "num_key_value_heads 2" in _refusal(Layout(tp=4), "llama")
    assert "intermediate_size 130" in _refusal(Layout(tp=4), "llama", num_key_value_heads=4, intermediate_size=130)


def test_sequence_parallel_needs_divisible_windows():
    msg = _refusal(Layout(tp=2), "llama", seq_lens=(33, 64), par=ParallelConfig(tp=2))
    assert "window length 33" in msg
    check_model(Layout(tp=2), _config("llama"), [33], ParallelConfig(tp=2, sequence_parallel=False))


def test_pipeline_needs_enough_blocks_and_untied_embeddings():
    assert "2 decoder blocks, fewer than the stages" in _refusal(Layout(pp=4), "mistral")
    assert "tie_word_embeddings: false" in _refusal(Layout(pp=2), "llama")  # the tiny llama ties
    assert "soft-caps the logits" in _refusal(Layout(pp=2), "gemma2")
    for arch in ("mistral", "qwen2", "qwen3", "phi3", "gemma", "mixtral"):
        check_model(Layout(pp=2), _config(arch, tie_word_embeddings=False), [64], ParallelConfig(pp=2))


def test_expert_parallelism_needs_a_mixture_of_experts_it_divides():
    assert num_experts(_config("mixtral")) == 4 and num_experts(_config("llama")) == 0
    assert "no routed experts" in _refusal(Layout(dp_shard=2, ep=2), "llama")
    assert "4 experts per block" in _refusal(Layout(dp_shard=8, ep=8), "mixtral")
    check_model(Layout(dp_shard=4, ep=4), _config("mixtral"), [64], ParallelConfig(ep=4))


@pytest.mark.parametrize("fields, words", [
    (dict(parallel=dict(tp=2), lora=dict(enabled=True)), "lora.enabled cannot run with parallel tp 2"),
    (dict(parallel=dict(pp=2), lora=dict(enabled=True)), "lora.enabled cannot run with parallel pp 2"),
    (dict(parallel=dict(pp=2), attention=dict(sliding_window=8)), "attention.sliding_window cannot run"),
    (dict(parallel=dict(pp=4), loss=dict(chunked=False)), "1f1b needs at least as many micro-batches"),
    (dict(parallel=dict(tp=2, ep=2)), "ep with tp is not supported"),
    (dict(parallel=dict(dp_shard=2)), "set distributed.fsdp: true"),
    (dict(parallel=dict(dp_shard=4, ep=3), distributed=dict(fsdp=True)), "must divide it"),
    (dict(parallel=dict(ep=2), distributed=dict(fsdp=True), compile=True), "compile.enabled cannot run"),
    (dict(parallel=dict(ep=2), distributed=dict(fsdp=True, cpu_offload=True)), "cpu_offload cannot run"),
    (dict(parallel=dict(tp=0)), "greater than or equal to 1"),
    (dict(parallel=dict(pp_schedule="zb")), "'gpipe' or '1f1b'"),
])
def test_the_config_refuses_what_the_splits_cannot_run_with(fields, words):
    with pytest.raises(ValidationError, match=words):
        LoopConfig(**fields)


def test_gpipe_takes_fewer_micro_batches_than_stages():
    cfg = LoopConfig(parallel=dict(pp=4, pp_schedule="gpipe"), loss=dict(chunked=False))
    assert cfg.parallel.multi_dim and cfg.batch.grad_accum_steps == 1


def _check(th, tmp_path, arch: str, world: int, **train) -> subprocess.CompletedProcess:
    recipe = th.tiny_recipe(tmp_path / "run", **train)
    recipe["model"]["config"] = dict(TINY_CONFIGS[arch], tie_word_embeddings=False)
    path = th.write_recipe(tmp_path / "r.yaml", recipe)
    cmd = [sys.executable, "-m", "train", str(path), "--check", "--world-size", str(world), "--quiet"]
    return subprocess.run(cmd, cwd=th.REPO, env=th.env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_check_prints_the_resolved_layout_and_refuses_in_one_line(th, tmp_path):
    ok = _check(th, tmp_path, "mixtral", 4, distributed=dict(fsdp=True), parallel=dict(ep=2))
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads(ok.stdout)
    assert report["parallel"] == {"dp_shard": 4, "tp": 1, "pp": 1, "ep": 2} and report["model_type"] == "mixtral"
    bad = _check(th, tmp_path, "llama", 16, distributed=dict(fsdp=True), parallel=dict(tp=8))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "error: train.parallel.tp 8 must divide the model's num_attention_heads 4: each rank takes 1/8 of them"]


def test_expert_split_takes_only_the_layout_it_computes():
    """The expert split computes Mixtral's experts layout ([gate; up] rows, no bias); another layout
    is refused with targets.moe's reason instead of being computed wrong."""
    from train.model_parts import meta_model
    from train.parallel.layout import check_modules

    moe = meta_model(_config("mixtral"))
    check_modules(Layout(dp_shard=2, ep=2), moe)
    moe.model.layers[1].mlp.experts.is_concatenated = False  # gate and up rows interleaved
    with pytest.raises(TrainInputError, match="train.parallel.ep 2: model.layers.1.mlp.experts .* interleave"):
        check_modules(Layout(dp_shard=2, ep=2), moe)
    with pytest.raises(TrainInputError, match="has no experts module"):
        check_modules(Layout(dp_shard=2, ep=2), meta_model(_config("llama")))
