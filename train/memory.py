"""Activation memory savers (checkpointing, offload) and peak-memory measurement.

Peak memory on CPU is the process's peak RSS (``VmHWM``), reset through
``/proc/self/clear_refs`` so each phase is measured on its own; on CUDA it is
``torch.cuda.max_memory_allocated``. Both are reported in MiB.
"""

from __future__ import annotations

import contextlib
import functools
import resource

import torch
from torch import nn

from train.config import MemoryConfig
from train.model_parts import decoder_blocks
from targets.process_memory import reset_peak_rss, status_bytes


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a causal LM (see :func:`train.model_parts.decoder_blocks`)."""
    blocks = [m for _, m in decoder_blocks(model)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint or shard")
    return blocks


_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, cfg: MemoryConfig) -> int:
    """Wrap blocks in non-reentrant checkpoints (before FSDP); returns how many were wrapped.

    ``selective`` keeps matmul and attention outputs and recomputes the cheap element-wise
    ops (norms, activations, RoPE), trading less memory saving for far less recompute.
    """
    if cfg.activation_checkpointing == "none":
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs = {}
    if cfg.activation_checkpointing == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    chosen = transformer_blocks(model)[:: cfg.checkpoint_every_n_layers]
    ids = {id(b) for b in chosen}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in ids:
                parent.register_module(name, checkpoint_wrapper(child, preserve_rng_state=True, **kwargs))
                count += 1
    return count


def activation_offload_context(enabled: bool, device: torch.device):
    """Saved activations go to host memory (pinned on CUDA) and come back for backward."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    reset_peak_rss()  # VmHWM (peak RSS) to the current RSS, where the kernel allows it


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = status_bytes("VmHWM")
    return hwm / 2**20 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
