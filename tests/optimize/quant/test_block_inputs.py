"""optimize/quant/block_inputs.py: the block-to-block cache GPTQ calibrates on is refused when
the blocks do not feed each other directly (its use is tested against the prefix rerun in
test_gptq.py)."""

from __future__ import annotations

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
