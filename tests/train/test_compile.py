"""train.compile: per-block torch.compile in place (torchtitan's way) and the compiled loss."""

from __future__ import annotations

import copy

import pytest
import torch

from train.compile import compile_blocks, uncompile
from train.config import CompileConfig, LoopConfig, MemoryConfig
from train.memory import apply_activation_checkpointing, transformer_blocks
from train.recipe import RecipeError, parse_recipe


def test_wrong_compile_values_name_the_yaml_path(tmp_path, th):
    recipe = th.tiny_recipe(tmp_path)
    assert parse_recipe(recipe, overrides=["train.compile=true"]).train.compile == CompileConfig(enabled=True)
    with pytest.raises(RecipeError, match=r"train\.compile: compile takes true, false or a mapping .* got 'fast'"):
        parse_recipe(th.tiny_recipe(tmp_path), overrides=["train.compile=fast"])
    with pytest.raises(RecipeError, match=r"train\.compile\.mode: Input should be 'default' or 'max-autotune-no-cudagraphs'"):
        parse_recipe(th.tiny_recipe(tmp_path), overrides=["train.compile.mode=reduce-overhead"])
    with pytest.raises(RecipeError, match=r"train\.compile: unknown key 'enable'"):
        parse_recipe(th.tiny_recipe(tmp_path), overrides=["train.compile.enable=true"])


def test_blocks_compile_in_place_and_uncompile(tiny_llama):
    names = [n for n, _ in tiny_llama.named_parameters()]
    assert compile_blocks(tiny_llama, CompileConfig()) == 0  # disabled: nothing
    assert compile_blocks(tiny_llama, CompileConfig(enabled=True)) == 2
    assert all(b._compiled_call_impl is not None for b in transformer_blocks(tiny_llama))
    assert tiny_llama._compiled_call_impl is None  # per block, not the whole model
    assert [n for n, _ in tiny_llama.named_parameters()] == names  # no _orig_mod: checkpoints keep their keys
    assert uncompile(tiny_llama) == 2
    assert all(b._compiled_call_impl is None for b in transformer_blocks(tiny_llama))


def test_checkpoint_wrappers_are_compiled_with_their_block(tiny_llama):
    apply_activation_checkpointing(tiny_llama, MemoryConfig(activation_checkpointing="full"))
    compile_blocks(tiny_llama, CompileConfig(enabled=True))
    wrappers = [m for m in tiny_llama.modules() if hasattr(m, "_checkpoint_wrapped_module")]
    assert len(wrappers) == 2 and all(w._compiled_call_impl is not None for w in wrappers)
    assert all(b._compiled_call_impl is None for b in transformer_blocks(tiny_llama))


@pytest.mark.slow
def test_compiled_run_matches_the_eager_run(tiny_llama, train_ids, tmp_path, th):
    """Same losses within 1e-4 (Inductor reorders fp32 reductions; the eager run is the reference),
    on CPU: the blocks and the chunked loss are compiled, the head check and the kernel watch
    run eagerly, and the model comes back uncompiled."""
    from train.loop import train

    eager = train(copy.deepcopy(tiny_llama), train_ids, th.loop_cfg(tmp_path / "eager"), seq_len=64)
    compiled = train(copy.deepcopy(tiny_llama), train_ids, th.loop_cfg(tmp_path / "compiled", compile=True), seq_len=64)
    assert compiled.compiled_blocks == 2 and eager.compiled_blocks == 0
    assert compiled.loss.endswith("compiled") and compiled.attention["kernel"] == eager.attention["kernel"]
    for step in (1, 2, 3):
        assert compiled.losses[step] == pytest.approx(eager.losses[step], abs=1e-4)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in compiled.model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_bf16_run_on_cuda_matches_eager(tiny_llama, train_ids, tmp_path):
    from train.loop import train

    def cfg(name, **kw):
        return LoopConfig(output_dir=tmp_path / name, max_steps=3, device="cuda", precision=dict(mode="bf16"),
                          checkpoint=dict(save_final=False, export_hf=False),
                          logging=dict(progress_bar=False, csv=False), **kw)

    eager = train(copy.deepcopy(tiny_llama), train_ids, cfg("eager"), seq_len=64)
    compiled = train(copy.deepcopy(tiny_llama), train_ids, cfg("compiled", compile=True), seq_len=64)
    assert compiled.compiled_blocks == 2 and compiled.device_name.startswith(("NVIDIA", "AMD"))
    for step in (1, 2, 3):
        assert compiled.losses[step] == pytest.approx(eager.losses[step], abs=2e-2)  # bf16 rounding
