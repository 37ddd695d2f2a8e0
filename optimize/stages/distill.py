"""Knowledge distillation: train the current model toward a teacher's next-token distribution.

The teacher defaults to ``ctx.baseline_model`` (the model as it entered the pipeline), so a
distill stage after a lossy stage (pruning, a rewrite, quantization-aware layers) pulls the
model back toward what it was; a ``teacher`` model source distils from a different (larger)
model that shares the tokenizer. The loss is KL at a temperature (scaled by T^2), mixed with
next-token cross-entropy on the real text by ``alpha``. Training runs on the shared loop
(``train.loop``) through :func:`optimize.heal.train_in_place`, on ``ctx.train_ids``, which is
disjoint from the evaluation text.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from optimize.heal import train_in_place
from optimize.losses import distill_loss_fn
from optimize.stage_api import StageConfig, StageContext, register_stage
from train.config import BatchConfig, MemoryConfig, OptimizerConfig, PrecisionConfig, ScheduleConfig
from train.sources import ModelSource


class TrainingStageConfig(StageConfig):
    """Training fields shared by the stages that fine-tune inside the pipeline (distill, qat)."""

    steps: int = Field(50, ge=1, description="optimizer steps")
    seq_len: int = Field(256, ge=8, description="tokens per training window (non-overlapping windows of ctx.train_ids)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of the KL term (loss scaled by T^2)")
    alpha: float = Field(
        0.0, ge=0, lt=1, description="weight of next-token cross-entropy on the real text; 1 - alpha weighs the KL"
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


class DistillConfig(TrainingStageConfig):
    kind: Literal["distill"] = "distill"
    teacher: ModelSource | None = Field(
        None,
        description="teacher model source (hf | gguf | bundled | random) sharing the tokenizer; "
        "default: the model as it entered the pipeline",
    )


def _device(m: nn.Module) -> torch.device:
    p = next(m.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _vocab(m: nn.Module) -> int | None:
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)
    return getattr(getattr(m, "config", None), "vocab_size", None)


def resolve_teacher(model: nn.Module, source, ctx: StageContext, who: str) -> nn.Module:
    """The loaded ``source`` (moved to the student's device) or ``ctx.baseline_model``."""
    if source is not None:
        from train.sources import load_model

        teacher = load_model(source).model.to(_device(model)).eval()
    else:
        teacher = ctx.baseline_model
        if teacher is None:
            raise ValueError(
                f"{who}: no teacher: the pipeline passed no baseline model (ctx.baseline_model is None); "
                "set `teacher` to a model source"
            )
        if _device(teacher) != _device(model):
            raise ValueError(
                f"{who}: the baseline teacher is on {_device(teacher)} but the model on {_device(model)}"
            )
        teacher.eval()
    sv, tv = _vocab(model), _vocab(teacher)
    if sv is not None and tv is not None and sv != tv:
        raise ValueError(
            f"{who}: the teacher's vocabulary has {tv} tokens, the model's {sv}; the teacher must share "
            "the student's tokenizer"
        )
    if source is not None:  # our own copy: freeze it (never touch the pipeline's baseline model)
        for p in teacher.parameters():
            p.requires_grad_(False)
    return teacher


def run_training(model: nn.Module, cfg: TrainingStageConfig, ctx: StageContext, teacher: nn.Module | None, who: str) -> dict:
    """Fine-tune ``model`` in place with the stage's loop settings; KL to ``teacher`` or plain LM loss."""
    loss_fn = distill_loss_fn(teacher, cfg.temperature, cfg.alpha) if teacher is not None else None
    return train_in_place(
        model,
        ctx.train_ids,
        loss_fn,
        steps=cfg.steps,
        seq_len=cfg.seq_len,
        optimizer=cfg.optimizer,
        schedule=cfg.schedule,
        batch=cfg.batch,
        grad_clip=cfg.grad_clip,
        precision=cfg.precision,
        memory=cfg.memory,
        seed=ctx.seed,
        progress=cfg.progress,
        who=who,
    )


@register_stage("distill", DistillConfig)
def distill(model: nn.Module, cfg: DistillConfig, ctx: StageContext) -> nn.Module:
    """Knowledge distillation on train text: KL to a teacher (default: the pre-pipeline model), optional CE mix."""
    teacher = resolve_teacher(model, cfg.teacher, ctx, "distill")
    facts = run_training(model, cfg, ctx, teacher, "distill")
    del teacher  # a loaded teacher is freed with the stage
    ctx.details.update(
        {
            "teacher": cfg.teacher.model_dump(mode="json") if cfg.teacher is not None else "baseline (pre-pipeline model)",
            "temperature": cfg.temperature,
            "alpha": cfg.alpha,
            "grad_accum_steps": cfg.batch.grad_accum_steps,
            "micro_batch_size": cfg.batch.micro_batch_size,
            **facts,
        }
    )
    ctx.log(
        f"distill: loss {facts['loss_first']:.4f} -> {facts['loss_last']:.4f} in {cfg.steps} steps "
        f"({facts['tokens_seen']} tokens)"
    )
    return model
