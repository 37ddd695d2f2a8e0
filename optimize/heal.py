"""A short healing run after a lossy rewrite: distil from the pre-rewrite model (KL to the
teacher's next-token distribution) or plain next-token fine-tuning on ``ctx.train_ids``.

Runs on the shared loop (:func:`train.loop.train`); :func:`train_in_place` is the adapter
every pipeline stage that trains (heal, ``distill``, ``qat``) goes through, so the stage
contract holds for all of them: the model is trained in place, comes back in the mode and
``requires_grad`` state it arrived in, with no gradients, no checkpoints written and the
HF ``use_cache`` flag restored.
Dropout is kept off (eval mode) while training: a few hundred steps of repair are not
pre-training, and it keeps the run deterministic for a given seed.
"""

from __future__ import annotations

import math
import tempfile
import time
from typing import Callable, Literal

import torch
from pydantic import Field
from torch import nn

from optimize.losses import distill_loss_fn
from targets.config_base import Strict
from train.config import (
    BatchConfig,
    CheckpointConfig,
    LoggingConfig,
    LoopConfig,
    MemoryConfig,
    OptimizerConfig,
    PrecisionConfig,
    ScheduleConfig,
)
from train.loop import causal_lm_loss


class HealConfig(Strict):
    """How to heal a rewritten model."""

    mode: Literal["distill", "lm"] = Field(
        "distill", description="distill: KL to the pre-rewrite model as teacher; lm: next-token loss on train text"
    )
    steps: int = Field(50, gt=0, description="optimizer steps")
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate (constant after a short warm-up)")
    seq_len: int = Field(256, ge=8, description="tokens per training window")
    batch_size: int = Field(2, gt=0, description="windows per step")
    warmup_steps: int = Field(5, ge=0, description="linear learning-rate warm-up steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    temperature: float = Field(1.0, gt=0, description="softmax temperature for distillation")
    progress: bool = Field(True, description="show a tqdm progress bar")


class HealError(ValueError):
    """Healing cannot run as configured."""


def check_tokens(train_ids: torch.Tensor, seq_len: int, windows: int, who: str) -> None:
    """The loop packs non-overlapping ``seq_len + 1`` windows and needs one step batch of them."""
    n = int(train_ids.numel())
    need = seq_len + 1
    if n < need:
        raise HealError(f"{who} needs at least seq_len+1={need} training tokens; ctx.train_ids has {n}")
    have = (n - 1) // seq_len
    if have < windows:
        raise HealError(
            f"{who}: ctx.train_ids ({n} tokens) holds {have} windows of seq_len={seq_len}, fewer than the "
            f"{windows} one optimizer step needs (batch x accumulation); lower seq_len or the batch"
        )


def _device_of(model: nn.Module) -> Literal["cpu", "cuda"]:
    p = next(model.parameters(), None)
    return "cuda" if p is not None and p.device.type == "cuda" else "cpu"


def _eval_mode(loss_fn):
    """The loop puts the model in train mode; switch dropout back off before every forward."""

    def wrapped(model, batch):
        model.eval()
        return loss_fn(model, batch)

    return wrapped


def _unwrap_checkpoints(model: nn.Module) -> int:
    """Undo the loop's activation-checkpoint wrappers: left in place, later stages, rewrites,
    resume and export would see a different module tree (and recompute on every forward)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper):
                parent.register_module(name, child._checkpoint_wrapped_module)
                count += 1
    return count


def train_in_place(
    model: nn.Module,
    train_ids: torch.Tensor,
    loss_fn,
    *,
    steps: int,
    seq_len: int,
    optimizer: OptimizerConfig,
    schedule: ScheduleConfig,
    batch: BatchConfig,
    grad_clip: float | None,
    precision: PrecisionConfig | None = None,
    memory: MemoryConfig | None = None,
    seed: int = 0,
    progress: bool = False,
    who: str = "train",
) -> dict:
    """Train ``model`` in place with :func:`train.loop.train`; returns loss/tokens facts.

    ``loss_fn=None`` is next-token cross-entropy. No checkpoint or export is written (the
    pipeline owns artifacts); the loop's scratch directory is temporary."""
    from train.loop import train

    check_tokens(train_ids, seq_len, batch.effective_per_rank, who)
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    was_training = model.training
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="optimize-train-") as scratch:
        loop = LoopConfig(
            output_dir=scratch,
            max_steps=steps,
            seed=seed,
            data_seed=seed,
            device=_device_of(model),
            grad_clip=grad_clip,
            batch=batch,
            optimizer=optimizer,
            schedule=schedule,
            precision=precision or PrecisionConfig(),
            memory=memory or MemoryConfig(),
            checkpoint=CheckpointConfig(resume=False, save_final=False, export_hf=False),
            logging=LoggingConfig(progress_bar=progress, csv=False),
        )
        try:
            with torch.inference_mode(False), torch.enable_grad():
                for p in model.parameters():
                    p.requires_grad_(True)
                result = train(model, train_ids.long(), loop, _eval_mode(loss_fn or causal_lm_loss), seq_len=seq_len)
        finally:
            _unwrap_checkpoints(model)
            for n, p in model.named_parameters():
                p.requires_grad_(grads.get(n, True))
                p.grad = None
            model.train(was_training)
            if use_cache is not None:
                config.use_cache = use_cache
    if result.model is not model:
        raise HealError(f"{who}: the training loop returned a different module (LoRA/FSDP are not used in stages)")
    losses = [result.losses[k] for k in sorted(result.losses)]
    bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
    if bad:
        raise HealError(f"{who} loss became {losses[bad[0]]} at step {bad[0]}; lower the learning rate")
    k = min(5, len(losses))
    stride = max(1, len(losses) // 50)
    return {
        "steps": steps,
        "lr": optimizer.lr,
        "seq_len": seq_len,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_first5_mean": sum(losses[:k]) / k,
        "loss_last5_mean": sum(losses[-k:]) / k,
        "loss_curve": losses[::stride],
        "tokens_seen": int(result.tokens),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def heal(
    model: nn.Module,
    cfg: HealConfig,
    train_ids: torch.Tensor,
    *,
    teacher: torch.nn.Module | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Train ``model`` in place; returns JSON-serializable facts (loss curve ends, settings)."""
    if cfg.mode == "distill" and teacher is None:
        raise HealError("heal mode 'distill' needs a teacher model")
    if teacher is not None:
        teacher.eval()
    loss_fn = distill_loss_fn(teacher, cfg.temperature) if cfg.mode == "distill" else None
    facts = train_in_place(
        model,
        train_ids,
        loss_fn,
        steps=cfg.steps,
        seq_len=cfg.seq_len,
        optimizer=OptimizerConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999)),
        schedule=ScheduleConfig(warmup_steps=cfg.warmup_steps, decay="constant"),
        batch=BatchConfig(micro_batch_size=cfg.batch_size),
        grad_clip=cfg.max_grad_norm,
        seed=seed,
        progress=cfg.progress,
        who="heal",
    )
    out = {"mode": cfg.mode, "batch_size": cfg.batch_size, **facts}
    log(f"heal ({cfg.mode}): loss {out['loss_first']:.4f} -> {out['loss_last']:.4f} in {cfg.steps} steps")
    return out
