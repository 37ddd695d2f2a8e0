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


def _recorded(chain) -> tuple[list, list]:
    return chain.calls, chain.hidden


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2"])
def test_capture_runs_the_blocks_on_the_first_window_only_and_records_what_they_would(model_type, monkeypatch):
    """Windows after the first pass through blocks that return their input (the blocks' other
    arguments come from the model's input): what is recorded equals a capture that runs every
    block on every window, and a block's layers run only for window 0 and the chain's check."""
    from tiny_families import family

    from optimize.quant import block_inputs
    from optimize.quant.block_inputs import BlockChain, _same
    from train.model_parts import decoder_blocks

    over = {"sliding_window": 16} if model_type == "gemma3_text" else {}
    model = family(model_type, **over)
    blocks = [n for n, _ in decoder_blocks(model)]
    inner = [m for m in model.get_submodule(blocks[0]).modules() if not list(m.children())][0]  # a layer of block 0
    calls = []
    inner.register_forward_pre_hook(lambda m, a: calls.append(1))
    windows = _windows(4)
    fast = BlockChain.capture(model, blocks, windows)
    assert fast.ok, fast.why
    assert len(calls) == 2  # window 0, then the chain's check replays block 0 on it
    monkeypatch.setattr(block_inputs, "_same", lambda a, b: False)  # the probe disagrees: every window runs
    calls.clear()
    slow = BlockChain.capture(model, blocks, windows)
    assert slow.ok and len(calls) == len(windows) + 1
    monkeypatch.undo()  # _same compares containers by calling itself
    assert _same(fast.calls, slow.calls) and _same(fast.hidden, slow.hidden)
    assert fast.tails == slow.tails or _same(list(fast.tails), list(slow.tails))


def test_capture_runs_every_block_when_a_block_argument_follows_the_hidden_states():
    """A model that derives a block's keyword argument from the previous block's output (here a
    hook scales block 1's position embeddings by its input) cannot pass windows through: the probe
    on window 0 sees the difference, and every window runs the real blocks."""
    from tiny_families import family

    from optimize.quant.block_inputs import BlockChain, _same
    from train.model_parts import decoder_blocks

    model = family("llama")
    blocks = [n for n, _ in decoder_blocks(model)]

    def follow(_m, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        return args, kwargs | {"position_embeddings": (cos * hidden.abs().mean(), sin)}

    model.get_submodule(blocks[1]).register_forward_pre_hook(follow, with_kwargs=True)
    windows = _windows(3)
    chain = BlockChain.capture(model, blocks, windows)
    assert chain.ok, chain.why
    want = []
    rec = model.get_submodule(blocks[1]).register_forward_pre_hook(
        lambda m, a, k: want.append(k["position_embeddings"][0].clone()), with_kwargs=True)
    with torch.no_grad():
        for w in windows:
            model(w.view(1, -1), use_cache=False)
    rec.remove()
    got = [kwargs["position_embeddings"][0] for _args, kwargs in chain.calls[1]]
    assert len(got) == len(windows) and _same(got, want)
