"""optimize/quant/block_inputs.py: the block-to-block cache GPTQ calibrates on is refused when
the blocks do not feed each other directly (its use is tested against the prefix rerun in
test_gptq.py)."""

from __future__ import annotations

import pytest
import torch


def test_block_chain_refuses_blocks_that_do_not_feed_each_other():
    """A model that transforms the hidden states between its blocks must not use the cache."""
    from tiny_families import family

    from optimize.quant.block_inputs import BlockChain
    from train.model_parts import decoder_blocks

    model = family("llama")
    blocks = [n for n, _ in decoder_blocks(model)]
    model.model.layers[1].register_forward_pre_hook(lambda m, a, k: ((a[0] * 2.0,) + a[1:], k), with_kwargs=True)
    chain = BlockChain.capture(model, blocks, [torch.arange(1, 17)])
    assert not chain.ok and "does not feed block 1" in chain.why


def _windows(n: int = 2, length: int = 48) -> list[torch.Tensor]:
    return [torch.randint(1, 500, (length,), generator=torch.Generator().manual_seed(s)) for s in range(n)]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3", "opt", "gpt_neox", "gpt2"])
def test_capture_stops_before_the_head_and_replay_reaches_it_with_the_carried_states(model_type):
    """The capture forward ends after the last block (the output head never runs), and with the
    chain advanced through every block, a forward under ``replay`` gives the model's own logits
    while no block computes anything. Covers tuple-returning blocks (gpt2), per-layer sliding masks
    (gemma3_text, a window shorter than the text), learned positions (opt) and parallel residuals
    (gpt_neox)."""
    from tiny_families import family

    from optimize.quant.block_inputs import BlockChain
    from train.model_parts import decoder_blocks

    over = {"sliding_window": 16} if model_type == "gemma3_text" else {}
    model = family(model_type, **over)
    blocks = [n for n, _ in decoder_blocks(model)]
    head = model.get_output_embeddings()
    head_calls = []
    hook = head.register_forward_pre_hook(lambda m, a: head_calls.append(1))
    windows = _windows()
    chain = BlockChain.capture(model, blocks, windows)
    assert chain.ok, chain.why
    assert head_calls == []  # stopped after the last block
    for i in range(len(blocks)):
        chain.advance(i)
    inner = [m for m in chain.mods[0].modules() if m is not chain.mods[0] and not list(m.children())][0]
    inner_calls = []
    inner_hook = inner.register_forward_pre_hook(lambda m, a: inner_calls.append(1))
    with torch.no_grad():
        for j, w in enumerate(windows):
            want = model(w.view(1, -1), use_cache=False).logits
            before = len(inner_calls)
            with chain.replay(j):
                got = model(w.view(1, -1), use_cache=False).logits
            assert len(inner_calls) == before  # the blocks answered from the chain
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hook.remove()
    inner_hook.remove()
    assert all("forward" not in m.__dict__ for m in chain.mods)  # the blocks' own forward is back
    assert len(head_calls) == 2 * len(windows)


def test_replay_refuses_an_unusable_chain():
    from tiny_families import family

    from optimize.quant.block_inputs import BlockChain
    from train.model_parts import decoder_blocks

    model = family("llama")
    chain = BlockChain(model, [n for n, _ in decoder_blocks(model)])
    chain.ok, chain.why = False, "forced"
    with pytest.raises(RuntimeError, match="forced"):
        with chain.replay(0):
            pass
