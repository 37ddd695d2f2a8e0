"""Attention at training time: every window/sparse variant equals a dense reference that applies
the same mask (several families), the SDPA kernel is selectable and the one that ran is
observed, and what cannot run here is refused with a clear message."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from train.attention import AttentionError, KernelRecorder, configure_attention, restore_attention, usable_sdpa_kernels
from train.config import AttentionConfig
from train.local_attention import blockwise_local_attention, dense_pattern_mask, pattern_mask_function

CPU = torch.device("cpu")
T, W, G = 300, 100, 3  # 3 query blocks in the blockwise path; windows well inside the sequence

FAMILIES = {
    "llama": dict(),
    "qwen2": dict(),
    "mistral": dict(sliding_window=200),  # a native window wider than ours: ours applies
    "mistral-narrow": dict(sliding_window=64),  # narrower: the native one applies, globals stay global
    "phi3": dict(pad_token_id=0),
    "gemma2": dict(head_dim=16, sliding_window=256),  # eager only (attention softcapping)
    "gemma3_text": dict(head_dim=16, sliding_window=256),
    "gpt2": None,
}


def _model(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=503, n_positions=512)
    else:
        cfg = AutoConfig.for_model(
            family.split("-")[0], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=503, max_position_embeddings=512, **FAMILIES[family],
        )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def _reference_logits(model, ids, window, global_tokens):
    """The model's own eager attention with the dense pattern given as a ready 4-D additive mask."""
    native = getattr(model.config, "sliding_window", None) if "mistral" in model.config.model_type else None
    w = min(window, native) if native else window
    allowed = dense_pattern_mask(ids.shape[1], w, global_tokens)
    add = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None].expand(ids.shape[0], 1, -1, -1)
    return model(input_ids=ids, attention_mask=add).logits


VARIANTS = [("sdpa", "blockwise"), ("sdpa", "mask"), ("eager", "mask")]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_and_sparse_variants_match_dense_reference(family):
    base = _model(family)
    ids = torch.randint(0, 503, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = base(input_ids=ids).logits
    checked = 0
    for g in (0, G):
        with torch.no_grad():
            ref = _reference_logits(base, ids, W, g)
        if not (family == "mistral-narrow" and g == 0):  # there the native window is the whole pattern
            assert (ref - full).abs().max() > 1e-2  # the pattern changes the logits: the test can fail
        for backend, mode in VARIANTS:
            if family == "gemma2" and backend == "sdpa":
                continue
            model = copy.deepcopy(base)
            cfg = AttentionConfig(backend=backend, sliding_window=W, global_tokens=g, window_impl=mode)
            setup = configure_attention(model, cfg, CPU, torch.float32, T + 1)
            with torch.no_grad():
                got = model(input_ids=ids).logits
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6, msg=f"{family} {backend}/{mode} g={g}")
            restore_attention(model, setup)
            assert model.config._attn_implementation == "eager"
            checked += 1
    assert checked == (2 if family == "gemma2" else 6)


def test_gemma2_refuses_sdpa_with_the_reason():
    with pytest.raises(AttentionError, match="attention.backend sdpa: Gemma2ForCausalLM does not support"):
        configure_attention(_model("gemma2"), AttentionConfig(backend="sdpa"), CPU, torch.float32, 64)


@pytest.mark.parametrize("g", [0, G])
def test_blockwise_gradients_match_dense_reference(g):
    base = _model("llama").train()
    ids = torch.randint(0, 503, (1, T), generator=torch.Generator().manual_seed(2))
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    _reference_logits(ref_model, ids, W, g).logsumexp(-1).mean().backward()
    configure_attention(model, AttentionConfig(backend="sdpa", sliding_window=W, global_tokens=g), CPU, torch.float32, T)
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_blockwise_function_on_uneven_blocks_and_gqa():
    """Direct check of the kernel: odd lengths, tiny and wide windows, grouped KV heads, a scale."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 203, 8, generator=gen)
    k, v = torch.randn(2, 2, 203, 8, generator=gen), torch.randn(2, 2, 203, 8, generator=gen)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for window, g in [(1, 0), (7, 2), (130, 0), (202, 5)]:
        out, _ = blockwise_local_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, window=window, global_tokens=g)
        ref = F.scaled_dot_product_attention(q, kr, vr, attn_mask=dense_pattern_mask(203, window, g), scale=0.3)
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6, msg=f"window {window} g {g}")


def test_block_sparse_flex_mask_matches_dense():
    """The same pattern as a flex_attention BlockMask (block-sparse; forward only: torch 2.13 has no
    flex backward on CPU, so training with backend flex_attention is CUDA-only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from transformers.masking_utils import and_masks, causal_mask_function

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 512, 16, generator=gen) for _ in range(3))
    mask_mod = and_masks(causal_mask_function, pattern_mask_function(W, G))
    block_mask = create_block_mask(mask_mod, None, None, 512, 512, device="cpu")
    assert block_mask.sparsity() > 40  # most 128x128 blocks are skipped
    with torch.no_grad(), pytest.warns(UserWarning):
        out = flex_attention(q, k, v, block_mask=block_mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_pattern_mask(512, W, G))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cfg,expected",
    [
        (dict(backend="sdpa"), "sdpa:flash"),
        (dict(backend="sdpa", sdpa_kernel="math"), "sdpa:math"),
        (dict(backend="sdpa", sdpa_kernel="flash", sliding_window=64), "sdpa:flash"),
        (dict(backend="sdpa", sdpa_kernel="math", sliding_window=64, window_impl="mask"), "sdpa:math"),
        (dict(backend="eager"), "eager (matmul + softmax)"),
    ],
)
def test_selected_kernel_is_the_one_observed(cfg, expected):
    model = _model("llama")
    setup = configure_attention(model, AttentionConfig(**cfg), CPU, torch.float32, 256)
    with setup.context(), KernelRecorder() as rec:
        model(input_ids=torch.randint(0, 503, (1, 200)))
    assert list(rec.observed()) == [expected]
    calls = 2 * (2 if cfg.get("window_impl") != "mask" and cfg.get("sliding_window") else 1)  # layers x blocks
    assert sum(rec.observed().values()) == calls


def test_cpu_kernels_are_probed():
    assert usable_sdpa_kernels(CPU, torch.float32, 64, masked=True) == ["flash", "math"]


def test_kernel_probe_passes_the_shapes_transformers_passes_with_gqa(monkeypatch):
    """On an H200, a pinned `efficient` with a GQA model (4 query heads, 2 KV heads) passed the old
    probe (equal heads) and died at step 1 ("No available kernel"): transformers hands SDPA the KV
    heads as they are with enable_gqa when there is no mask, and the efficient kernel has no GQA.
    The probe now sees those shapes; with a mask, the KV heads are repeated first, as transformers does."""
    import train.attention as attention

    seen = []

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append((q.shape[1], k.shape[1], enable_gqa, attn_mask is not None))
        return "none"

    monkeypatch.setattr(attention, "sdpa_choice", record)
    usable_sdpa_kernels(CPU, torch.float32, 16, masked=False, heads=4, kv_heads=2)
    assert set(seen) == {(4, 2, True, False)}
    seen.clear()
    usable_sdpa_kernels(CPU, torch.float32, 16, masked=True, heads=4, kv_heads=2)
    assert set(seen) == {(4, 4, False, True)}
    seen.clear()
    usable_sdpa_kernels(CPU, torch.float32, 16, masked=False)
    assert set(seen) == {(2, 2, False, False)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_efficient_kernel_with_gqa_is_refused_before_training_on_cuda():
    model = _model("llama")  # GQA: fewer KV heads than query heads
    with pytest.raises(AttentionError, match="sdpa_kernel efficient cannot run on cuda .*sharing .* KV heads"):
        configure_attention(model, AttentionConfig(backend="sdpa", sdpa_kernel="efficient"), torch.device("cuda"),
                            torch.bfloat16, 64)


def test_refusals_name_the_option_and_what_works():
    model = _model("llama")
    with pytest.raises(AttentionError, match="flash_attention_2 needs a CUDA device; this run is on cpu"):
        configure_attention(model, AttentionConfig(backend="flash_attention_2"), CPU, torch.float32, 64)
    with pytest.raises(AttentionError, match="flex_attention cannot train on cpu: .*backward on CPU"):
        configure_attention(model, AttentionConfig(backend="flex_attention"), CPU, torch.float32, 64)
    with pytest.raises(AttentionError, match="sdpa_kernel efficient cannot run on cpu .*usable here: flash, math"):
        configure_attention(model, AttentionConfig(backend="sdpa", sdpa_kernel="efficient"), CPU, torch.float32, 64)
    with pytest.raises(AttentionError, match="sliding_window 64 is not smaller than the training context \\(64"):
        configure_attention(model, AttentionConfig(sliding_window=64), CPU, torch.float32, 64)
    assert model.config._attn_implementation == "eager"  # refused before anything changed


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(global_tokens=4), "global_tokens adds global positions to a sliding window; set sliding_window"),
        (dict(window_impl="mask"), "window_impl mask needs sliding_window"),
        (dict(backend="eager", sdpa_kernel="math"), "sdpa_kernel math applies to backend sdpa, not eager"),
        (dict(backend="eager", sliding_window=8, window_impl="blockwise"), "window_impl blockwise runs on SDPA"),
        (dict(backend="flash_attention_2", sliding_window=8, global_tokens=2), "flash-attn has sliding windows but no"),
        (dict(sliding_window=0), "greater than or equal to 1"),
        (dict(sliding_window=8, global_tokens=-1), "global_tokens\n  Input should be greater than or equal to 0"),
        (dict(sliding_window=8, window_impl="dense"), "Input should be 'auto', 'blockwise' or 'mask'"),
        (dict(sdpa_kernel="fast"), "Input should be 'auto', 'flash', 'efficient', 'cudnn' or 'math'"),
        (dict(backend="xformers"), "Input should be 'sdpa', 'eager', 'flash_attention_2' or 'flex_attention'"),
    ],
)
def test_bad_attention_options(fields, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        AttentionConfig(**fields)


def test_observed_kernel_accounts_for_autocast():
    """Under bf16 autocast RoPE leaves q, k in fp32 and v in bf16; SDPA sees them after autocast's
    cast, so the kernel is still the flash one (asking the dispatcher with the raw mixed dtypes
    would wrongly answer math)."""
    model = _model("llama")
    setup = configure_attention(model, AttentionConfig(backend="sdpa"), CPU, torch.bfloat16, 128)
    with setup.context(), torch.autocast("cpu", dtype=torch.bfloat16), KernelRecorder() as rec:
        model(input_ids=torch.randint(0, 503, (1, 64)))
    assert list(rec.observed()) == ["sdpa:flash"]


def test_flash_attn_is_picked_on_cuda_only_when_installed_and_nothing_pins_the_backend(monkeypatch):
    """The decision is testable without a GPU: CUDA availability and the package are faked; the
    kernels themselves need a GPU (no GPU in CI: the flash-attn forward is not exercised here)."""
    import importlib.util

    import train.attention as attention
    from train.attention import auto_flash_attn

    eager = _model("llama")  # built with attn_implementation="eager": the model's own choice is kept
    model = copy.deepcopy(eager)
    model.set_attn_implementation("sdpa")
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(attention.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    assert auto_flash_attn(model, AttentionConfig(), cuda, bf16) == "flash_attention_2"
    # anything that pins SDPA, or that flash-attn cannot do, or another device/dtype keeps SDPA
    assert auto_flash_attn(model, AttentionConfig(backend="sdpa"), cuda, bf16) is None
    assert auto_flash_attn(model, AttentionConfig(sdpa_kernel="math"), cuda, bf16) is None
    assert auto_flash_attn(model, AttentionConfig(sliding_window=64, global_tokens=4), cuda, bf16) is None
    assert auto_flash_attn(model, AttentionConfig(), torch.device("cpu"), bf16) is None
    assert auto_flash_attn(model, AttentionConfig(), cuda, torch.float32) is None
    assert auto_flash_attn(eager, AttentionConfig(), cuda, bf16) is None
    monkeypatch.setattr(attention.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a))
    assert auto_flash_attn(model, AttentionConfig(), cuda, bf16) is None
