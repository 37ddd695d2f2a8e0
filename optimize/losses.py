"""Distillation losses shared by every stage that trains against a teacher (heal, distill, qat).

One definition on purpose: the temperature scaling and the reduction decide what "KL to the
teacher" means in every report, so they must not drift between stages. :class:`DistillLoss`
adds what healing a pruned model needs (Minitron's recipe): CE on the labels and the MSE
between matching blocks' hidden states, each with its own weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.chunked_loss import chunked_kl_to_teacher
from train.lm_head import ChunkedLossError, lm_hidden_and_head
from train.model_parts import decoder_blocks


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


def normalized_mse(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``||s - t||^2 / ||t||^2``: scale-free, so one weight suits every layer and model (the
    residual stream's size grows with depth and differs between models)."""
    t = teacher.float()
    return (student.float() - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-12)


class _BlockOutputs:
    """Forward hooks that keep the outputs of chosen decoder blocks from the latest forward.

    A block re-run by activation checkpointing during backward does not overwrite what the
    loss already used (the first output of each forward is kept until :meth:`clear`)."""

    def __init__(self, model: nn.Module, indices: list[int]):
        blocks = [m for _, m in decoder_blocks(model)]
        bad = [i for i in indices if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"block index(es) {bad} out of range: {type(model).__name__} has {len(blocks)} blocks")
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = [blocks[i].register_forward_hook(self._hook(i)) for i in indices]

    def _hook(self, i: int):
        def fn(_module, _args, output):
            if i not in self.outputs:
                self.outputs[i] = output[0] if isinstance(output, (tuple, list)) else output
        return fn

    def clear(self) -> None:
        self.outputs = {}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.outputs = {}


class DistillLoss:
    """A ``train.loop`` loss: ``(1 - alpha) * T^2 * KL(teacher || student) + alpha * CE(labels)
    + hidden_weight * mean_l nMSE(proj(h_student[l]), h_teacher[layer_map[l]])``.

    - KL and CE: with ``chunk_size`` the logits are computed chunk by chunk from the final
      hidden states (:func:`train.chunked_loss.chunked_kl_to_teacher`: no ``[tokens, vocab]``
      tensor), the same value and gradient as the plain formula; without it, or when the
      output head is not a plain ``nn.Linear`` (a QAT fake-quantized head), full logits.
    - hidden-state MSE: outputs of student block ``l`` against teacher block ``layer_map[l]``
      (a depth-pruned student maps to the teacher blocks it kept), through ``projection``
      (a learned Linear) when the hidden sizes differ. Call :meth:`close` to remove the hooks.
    """

    def __init__(self, teacher: nn.Module, *, temperature: float = 1.0, alpha: float = 0.0, hidden_weight: float = 0.0,
                 layer_map: dict[int, int] | None = None, projection: nn.Module | None = None,
                 chunk_size: int | None = None, student: nn.Module | None = None):
        self.teacher, self.temperature, self.alpha = teacher, float(temperature), float(alpha)
        self.hidden_weight, self.projection, self.chunk_size = float(hidden_weight), projection, chunk_size
        self.layer_map = dict(layer_map or {})
        self._student_blocks = self._teacher_blocks = None
        if self.hidden_weight > 0:
            if student is None or not self.layer_map:
                raise ValueError("hidden_weight > 0 needs the student model and a non-empty layer_map")
            self._student_blocks = _BlockOutputs(student, sorted(self.layer_map))
            self._teacher_blocks = _BlockOutputs(teacher, sorted(set(self.layer_map.values())))

    def close(self) -> None:
        for hooks in (self._student_blocks, self._teacher_blocks):
            if hooks is not None:
                hooks.close()

    def _chunked(self, model: nn.Module) -> bool:
        if not self.chunk_size:
            return False
        heads = [m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
                 for m in (model, self.teacher)]
        return all(type(h) is nn.Linear for h in heads)

    def logit_terms(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(1 - alpha) * T^2 * KL + alpha * CE`` on this batch."""
        ids, labels = batch["input_ids"], batch["labels"]
        if self._chunked(model):
            try:
                with torch.no_grad():
                    t_hidden, t_head = lm_hidden_and_head(self.teacher, ids)
                hidden, head = lm_hidden_and_head(model, ids)
            except ChunkedLossError:  # a model that cannot hand out its final hidden states: full logits
                self.chunk_size = None
            else:
                return chunked_kl_to_teacher(hidden, head, t_hidden, t_head, temperature=self.temperature,
                                             labels=labels if self.alpha > 0 else None, alpha=self.alpha,
                                             chunk_size=self.chunk_size)
        with torch.no_grad():
            t_logits = _logits(self.teacher(input_ids=ids, use_cache=False)).float()
        logits = _logits(model(input_ids=ids, use_cache=False)).float()
        loss = kl_to_teacher(logits, t_logits, self.temperature)
        if self.alpha > 0:
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss = (1 - self.alpha) * loss + self.alpha * ce
        return loss

    def hidden_term(self) -> torch.Tensor:
        """Mean normalized MSE over the mapped blocks of the latest forward."""
        s_out, t_out = self._student_blocks.outputs, self._teacher_blocks.outputs
        terms = []
        for s_idx, t_idx in sorted(self.layer_map.items()):
            h = s_out[s_idx]
            if self.projection is not None:
                h = self.projection(h)
            terms.append(normalized_mse(h, t_out[t_idx].detach()))
        return torch.stack(terms).mean()

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self._student_blocks is not None:
            self._student_blocks.clear()
            self._teacher_blocks.clear()
        loss = self.logit_terms(model, batch)
        if self.hidden_weight > 0:
            loss = loss + self.hidden_weight * self.hidden_term()
        return loss
