"""Short fine-tunes inside the pipeline: healing after a lossy rewrite (``gqa``, ``rmsnorm``),
distillation (``distill``) and quantization-aware training (``qat``).

One config shape (:class:`FinetuneConfig`, the trainer's names) and one adapter onto the
shared loop (:func:`train.loop.train`): :func:`train_in_place`, which every stage that trains
goes through, so the stage contract holds for all of them: the model is trained in place,
comes back in the mode and ``requires_grad`` state it arrived in, with no gradients, no
checkpoints written and the HF ``use_cache`` flag restored.
Dropout is kept off (eval mode) while training: a few hundred steps of repair are not
pre-training, and it keeps the run deterministic for a given seed.
"""

from __future__ import annotations

import math
import tempfile
import time
from typing import Callable, Literal

import torch
from pydantic import Field, model_validator
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


class FinetuneConfig(Strict):
    """A short fine-tune inside the pipeline, in the trainer's own names (``optimizer.lr``,
    ``batch.micro_batch_size``, ``grad_clip``): the ``heal`` block of the rewrite stages and
    the training fields of ``distill`` and ``qat`` are all this one shape."""

    loss: Literal["distill", "lm"] = Field(
        "distill", description="distill: KL to a teacher (the model before the stage, unless the stage says "
        "otherwise), plus alpha x CE; lm: next-token cross-entropy on the training text alone"
    )
    steps: int = Field(50, ge=1, description="optimizer steps")
    seq_len: int = Field(256, ge=8, description="tokens per training window (non-overlapping windows of ctx.train_ids)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of the KL term (loss scaled by T^2)")
    alpha: float = Field(
        0.0, ge=0, lt=1, description="loss: distill only: weight of next-token cross-entropy; 1 - alpha weighs the KL"
    )
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this (null = off)")
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(lr=5e-5),
        description="train loop optimizer (AdamW); a small lr because the model is already trained",
    )
    schedule: ScheduleConfig = Field(
        default_factory=lambda: ScheduleConfig(warmup_steps=0, decay="constant"),
        description="train loop learning-rate schedule",
    )
    batch: BatchConfig = Field(
        default_factory=lambda: BatchConfig(micro_batch_size=2),
        description="windows per micro-batch and gradient accumulation steps",
    )
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="fp32 or bf16/fp16 autocast")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="activation checkpointing/offload")
    progress: bool = Field(False, description="show the train loop's tqdm bar")

    @model_validator(mode="after")
    def _alpha_needs_distill(self):
        if self.loss == "lm" and self.alpha:
            raise ValueError("alpha mixes CE into the distillation loss; with loss: lm it must stay 0")
        return self


class FinetuneError(ValueError):
    """A fine-tune cannot run as configured, or diverged."""


def check_tokens(train_ids: torch.Tensor, seq_len: int, windows: int, who: str) -> None:
    """The loop packs non-overlapping ``seq_len + 1`` windows and needs one step batch of them."""
    n = int(train_ids.numel())
    need = seq_len + 1
    if n < need:
        raise FinetuneError(f"{who} needs at least seq_len+1={need} training tokens; ctx.train_ids has {n}")
    have = (n - 1) // seq_len
    if have < windows:
        raise FinetuneError(
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
        raise FinetuneError(f"{who}: the training loop returned a different module (LoRA/FSDP are not used in stages)")
    losses = [result.losses[k] for k in sorted(result.losses)]
    bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
    if bad:
        raise FinetuneError(f"{who} loss became {losses[bad[0]]} at step {bad[0]}; lower the learning rate")
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


def finetune(
    model: nn.Module,
    cfg: FinetuneConfig,
    train_ids: torch.Tensor,
    *,
    teacher: nn.Module | None = None,
    loss_fn=None,
    seed: int = 0,
    who: str = "finetune",
    log: Callable[[str], None] = print,
) -> dict:
    """Fine-tune ``model`` in place as ``cfg`` says; returns JSON-serializable facts.

    ``loss: distill`` needs ``teacher``; ``loss_fn`` (``(model, batch) -> loss``) replaces the
    loss ``cfg`` would build, for stages with losses of their own."""
    if loss_fn is None:
        if cfg.loss == "distill":
            if teacher is None:
                raise FinetuneError(f"{who}: loss 'distill' needs a teacher model")
            teacher.eval()
            loss_fn = distill_loss_fn(teacher, cfg.temperature, cfg.alpha)
    facts = train_in_place(
        model,
        train_ids,
        loss_fn,
        steps=cfg.steps,
        seq_len=cfg.seq_len,
        optimizer=cfg.optimizer,
        schedule=cfg.schedule,
        batch=cfg.batch,
        grad_clip=cfg.grad_clip,
        precision=cfg.precision,
        memory=cfg.memory,
        seed=seed,
        progress=cfg.progress,
        who=who,
    )
    out = {"loss": cfg.loss, "micro_batch_size": cfg.batch.micro_batch_size,
           "grad_accum_steps": cfg.batch.grad_accum_steps, **facts}
    log(f"{who} ({cfg.loss}): loss {out['loss_first']:.4f} -> {out['loss_last']:.4f} in {cfg.steps} steps "
        f"({out['tokens_seen']} tokens)")
    return out
