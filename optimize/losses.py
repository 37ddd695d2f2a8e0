"""Distillation losses shared by every stage that trains against a teacher (heal, distill, qat).

One definition on purpose: the temperature scaling and the reduction decide what "KL to the
teacher" means in every report, so they must not drift between stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) per token, averaged over tokens, scaled by T^2 (Hinton et al.) so
    the gradient size does not shrink as the temperature grows."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ; the teacher must share the student's tokenizer/vocabulary"
        )
    v = student_logits.shape[-1]
    s_log = F.log_softmax(student_logits.float() / temperature, dim=-1).reshape(-1, v)
    t_log = F.log_softmax(teacher_logits.float() / temperature, dim=-1).reshape(-1, v)
    return F.kl_div(s_log, t_log, log_target=True, reduction="batchmean") * (temperature * temperature)


def distill_loss_fn(teacher: nn.Module, temperature: float = 1.0, alpha: float = 0.0):
    """A ``train.loop`` loss: ``(1 - alpha) * KL(teacher || student) * T^2 + alpha * CE(labels)``.

    The teacher runs under ``no_grad`` on the same ``input_ids``; ``alpha=0`` is pure distillation."""

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = _logits(model(input_ids=ids, use_cache=False)).float()
        with torch.no_grad():
            t_logits = _logits(teacher(input_ids=ids, use_cache=False)).float()
        loss = kl_to_teacher(logits, t_logits, temperature)
        if alpha > 0:
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
            loss = (1 - alpha) * loss + alpha * ce
        return loss

    return loss_fn
