"""Knowledge distillation: train the current model toward a teacher's next-token distribution.

The teacher defaults to ``ctx.baseline_model`` (the model as it entered the pipeline), so a
distill stage after a lossy stage (pruning, a rewrite, quantization-aware layers) pulls the
model back toward what it was; a ``teacher`` model source distils from a different (larger)
model that shares the tokenizer. The loss is KL at a temperature (scaled by T^2), mixed with
next-token cross-entropy on the real text by ``alpha``. Training runs on the shared loop
(``train.loop``) through :func:`optimize.finetune.finetune`, on ``ctx.train_ids``, which is
disjoint from the evaluation text.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from optimize.finetune import FinetuneConfig, finetune
from optimize.stage_api import StageConfig, StageContext, register_stage
from train.sources import ModelSource


class TrainingStageConfig(StageConfig, FinetuneConfig):
    """Stages that fine-tune inside the pipeline (distill, qat): the stage fields plus
    :class:`~optimize.finetune.FinetuneConfig`, the same shape as the rewrite stages' ``heal``."""


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
    """Fine-tune ``model`` in place with the stage's settings: KL to ``teacher`` (loss: distill) or LM loss."""
    return finetune(model, cfg, ctx.train_ids, teacher=teacher, seed=ctx.seed, who=who, log=lambda _msg: None)


@register_stage("distill", DistillConfig)
def distill(model: nn.Module, cfg: DistillConfig, ctx: StageContext) -> nn.Module:
    """Knowledge distillation on train text: KL to a teacher (default: the pre-pipeline model), optional CE mix."""
    teacher = resolve_teacher(model, cfg.teacher, ctx, "distill") if cfg.loss == "distill" else None
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
