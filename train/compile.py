"""``train.compile``: ``torch.compile`` per transformer block, as torchtitan applies it.

Why per block and in place: every decoder block runs the same code, so Dynamo traces it once
and the other blocks reuse the graph (parameters are graph inputs), compile time does not grow
with depth, and a graph break stays inside one block. ``nn.Module.compile()`` keeps the module
itself (no ``_orig_mod`` wrapper), so parameter names, checkpoints, activation checkpointing
and FSDP2 (applied after this, one ``fully_shard`` per block) see the same model as without it.

The loss is compiled separately (``chunked_lm_loss(..., compiled=True)``): its per-chunk
softmax gradient becomes one fused pass instead of several over ``[chunk, vocab]``.

Some passes are better left eager (:func:`eager`): the one-off head check in eval/no-grad mode
(compiling it would trace every block a second time for one forward) and the first forward of
each window length, which a ``TorchFunctionMode`` watches to see which attention kernel runs.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from train.config import CompileConfig
from train.memory import transformer_blocks

log = logging.getLogger("optimize.train")


def _outermost(model: nn.Module, block: nn.Module) -> nn.Module:
    """The block, or the activation-checkpoint wrapper around it (compiled together, as torchtitan does)."""
    for m in model.modules():
        if getattr(m, "_checkpoint_wrapped_module", None) is block:
            return m
    return block


def compile_blocks(model: nn.Module, cfg: CompileConfig) -> int:
    """Compile each transformer block in place; returns how many. Call before FSDP2 wraps them."""
    if not cfg.enabled:
        return 0
    kwargs = {} if cfg.mode == "default" else {"mode": cfg.mode}
    blocks = transformer_blocks(model)
    for block in blocks:
        _outermost(model, block).compile(**kwargs)
    return len(blocks)


def uncompile(model: nn.Module) -> int:
    """Drop the compiled forwards (after training the model goes on eager: eval, export, a
    later stage); returns how many modules had one."""
    n = 0
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
            n += 1
    return n


def eager(enabled: bool = True):
    """Run compiled modules' original Python code inside this context (``force_eager`` stance)."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")
