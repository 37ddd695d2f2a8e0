"""One training step: its loss, its precision, and the optimizer step over its micro-batches.

The loss is next-token cross-entropy by default (:func:`default_loss`: chunked through the output
head unless ``loss.chunked`` is off, optionally compiled); a caller's ``loss_fn(model, batch)``
(the distillation KL, say) replaces it. :func:`optimizer_step` accumulates gradients over the
micro-batches under the step's autocast, SDPA kernel and activation offload, retries smaller on
an out-of-memory error when the batch plan is dynamic, clips and steps, and returns the loss and
gradient norm as device tensors: the loop (:mod:`train.loop`) decides when to read them back.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from train.attention import AttentionSetup, KernelRecorder
from train.batching import is_oom
from train.chunked_loss import chunked_lm_loss
from train.compile import eager
from train.config import LoopConfig
from train.data import split_micro
from train.memory import activation_offload_context
from train.optim import clip_offloaded_grads

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy; labels are already shifted by the data pipeline."""
    out = model(input_ids=batch["input_ids"], use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def _autocast(mode: str, device: torch.device, fsdp: bool):
    if mode == "fp32" or fsdp:  # under FSDP the MixedPrecisionPolicy casts instead
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if mode == "bf16" else torch.float16)


def step_precision(cfg: LoopConfig, device: torch.device):
    """The autocast every forward of a training step runs under (a no-op for fp32 and under FSDP)."""
    return _autocast(cfg.precision.mode, device, cfg.distributed.fsdp)


def _compiled_causal_lm_loss() -> LossFn:
    """:func:`causal_lm_loss` with its fp32 cross-entropy through ``torch.compile`` (full-logits path)."""

    def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    ce = torch.compile(cross_entropy)

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = model(input_ids=batch["input_ids"], use_cache=False)
        return ce(out.logits if hasattr(out, "logits") else out, batch["labels"])

    return loss_fn


def default_loss(cfg: LoopConfig) -> tuple[LossFn, str]:
    compiled = cfg.compile.enabled and cfg.compile.loss
    suffix = ", compiled" if compiled else ""
    if cfg.loss.chunked:
        name = f"cross-entropy, chunked ({cfg.loss.chunk_size} tokens per chunk){suffix}"
        return chunked_lm_loss(cfg.loss.chunk_size, compiled=compiled), name
    return (_compiled_causal_lm_loss() if compiled else causal_lm_loss), f"cross-entropy, full fp32 logits{suffix}"


def _forward(model, mb, loss_fn, attn: AttentionSetup, record: bool, compiled: bool):
    """The loss of one micro-batch; ``record`` watches it for the attention kernels that run
    (eagerly: compiled code would not show the mode its calls, and would trace once more for it)."""
    if not record:
        return loss_fn(model, mb)
    with eager(compiled), KernelRecorder() as rec:
        loss = loss_fn(model, mb)
    attn.observe(mb["input_ids"].shape[1], rec.observed())
    return loss


def _clip(model, cfg: LoopConfig, ctx) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    if ctx.parallel is not None:  # gradients on several meshes, or on one pipeline stage only
        from train.parallel.grad_norm import clip_grads

        return clip_grads(params, cfg.grad_clip, ctx.parallel)
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def optimizer_step(
    model, batch, cfg: LoopConfig, loss_fn, optimizer, scaler, plan, ctx, fsdp, attn: AttentionSetup, record: bool,
    pipeline=None,
) -> dict:
    """Accumulate gradients over micro-batches (retrying smaller on OOM if dynamic), clip, step.

    Returns the step's loss and gradient norm as device tensors: nothing here waits for the device.
    The SDPA kernel choice covers backward too: activation checkpointing recomputes attention there.
    With ``pipeline`` (a pipelining schedule) the schedule runs the micro-batches instead; the loss
    is the last stage's (0 on the others)."""
    if pipeline is not None:
        from train.parallel.pipeline import pipeline_step

        with attn.context():
            loss_sum = pipeline_step(pipeline, ctx.parallel, batch)
        return _finish_step(model, cfg, optimizer, None, ctx, loss_sum)
    total_tokens = batch["labels"].numel()
    while True:
        try:
            loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
            micros = split_micro(batch, plan.micro)
            for i, mb in enumerate(micros):
                if fsdp:  # reduce-scatter gradients only on the last micro-batch
                    model.set_requires_gradient_sync(i == len(micros) - 1)
                with attn.context():
                    with step_precision(cfg, ctx.device), activation_offload_context(
                        cfg.memory.activation_offload, ctx.device
                    ):
                        loss = _forward(model, mb, loss_fn, attn, record and i == 0, cfg.compile.enabled)
                    weighted = loss * (mb["labels"].numel() / total_tokens)
                    (scaler.scale(weighted) if scaler is not None else weighted).backward()
                loss_sum += weighted.detach().float()
            break
        except Exception as exc:
            if not (cfg.batch.dynamic and is_oom(exc)):
                raise
            optimizer.zero_grad(set_to_none=True)
            plan.shrink(exc)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    return _finish_step(model, cfg, optimizer, scaler, ctx, loss_sum)


def _finish_step(model, cfg: LoopConfig, optimizer, scaler, ctx, loss_sum: torch.Tensor) -> dict:
    """Unscale, clip by the global norm, step and clear the gradients."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = _clip(model, cfg, ctx)
    clip_offloaded_grads(optimizer, norm, cfg.grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_sum, "grad_norm": norm.detach()}
