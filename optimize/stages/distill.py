"""Knowledge distillation: train the current model toward a teacher's next-token distribution.

The teacher defaults to ``ctx.baseline_model`` (the model as it entered the pipeline), so a
distill stage after a lossy stage (pruning, a rewrite, quantization-aware layers) pulls the
model back toward what it was; a ``teacher`` model source distils from a different (larger)
model that shares the tokenizer. The loss (:class:`optimize.losses.DistillLoss`) is KL at a
temperature (scaled by T^2), mixed with next-token cross-entropy on the real text by ``alpha``,
plus, with ``hidden_weight``, the normalized MSE between the outputs of matching blocks: after
a depth ``prune`` each student block is matched to the teacher block it came from (read from
``config.pruning``), and a learned projection bridges different hidden sizes (a larger
teacher). Training runs on the shared loop (``train.loop``) through
:func:`optimize.finetune.finetune`, on ``ctx.train_ids``, which is disjoint from the
evaluation text; with ``checkpoint_every_n_steps`` a killed run resumes mid-stage. ``data:
teacher_answers`` (or ``both``) trains on the teacher's own greedy answers to prompts made from that
text instead (:mod:`optimize.teacher_answers`), what a speculative-decoding draft must predict.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from optimize.finetune import FinetuneConfig, finetune
from optimize.losses import DistillLoss
from optimize.prune.records import kept_hidden, layer_map
from optimize.stage_api import StageConfig, StageContext, register_stage
from optimize.teacher_answers import TeacherAnswers, teacher_answers
from train.model_parts import decoder_blocks
from targets.sources import ModelSource, load_model


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
    hidden_weight: float = Field(
        0.0, ge=0, description="weight of the hidden-state loss: normalized MSE between the outputs of "
        "matching student and teacher blocks (0 = off)"
    )
    hidden_layers: list[int] | None = Field(
        None, min_length=1, description="hidden_weight only: student blocks whose outputs are matched "
        "(default: every block)"
    )
    layer_map: dict[int, int] | None = Field(
        None, min_length=1, description="hidden_weight only: student block -> teacher block; default: from the "
        "prune stages' record (a depth-pruned student maps to the blocks it kept), else spread evenly"
    )
    data: Literal["text", "teacher_answers", "both"] = Field(
        "text", description="what the student trains on: the run's training text; the teacher's own greedy answers to "
        "prompts made from that text (optimize/teacher_answers.py: what a speculative-decoding draft must predict); "
        "or both, answers first")
    answers: TeacherAnswers | None = Field(
        None, description="data: teacher_answers / both: how many answers the teacher writes (default 240 prompts, "
        "answers of up to 128 tokens)")

    @model_validator(mode="after")
    def _answers_with_data(self) -> "DistillConfig":
        if self.answers is not None and self.data == "text":
            raise ValueError("answers sizes the teacher's answers; it applies with data: teacher_answers or both")
        return self

    @model_validator(mode="after")
    def _hidden_options(self) -> "DistillConfig":
        if self.hidden_weight == 0 and (self.hidden_layers is not None or self.layer_map is not None):
            raise ValueError("hidden_layers and layer_map apply only with hidden_weight > 0")
        if self.hidden_weight > 0 and self.loss != "distill":
            raise ValueError("hidden_weight needs loss: distill (a teacher to match)")
        return self


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


def run_training(model: nn.Module, cfg: TrainingStageConfig, ctx: StageContext, teacher: nn.Module | None, who: str,
                 loss_fn=None, train_ids: torch.Tensor | None = None) -> dict:
    """Fine-tune ``model`` in place with the stage's settings: KL to ``teacher`` (loss: distill) or LM loss, on
    ``train_ids`` (default: the run's training text). Each training step is reported through ``ctx.progress``
    (phase ``train``: step, loss, tokens/s, ETA)."""
    return finetune(model, cfg, ctx.train_ids if train_ids is None else train_ids, teacher=teacher, loss_fn=loss_fn,
                    seed=ctx.seed, who=who, log=ctx.log, work_dir=ctx.work_dir, progress=ctx.progress)


def training_text(cfg: DistillConfig, ctx: StageContext, teacher: nn.Module | None) -> tuple[torch.Tensor, dict]:
    """The stage's training tokens (``data``) and what they are, for the details."""
    if cfg.data == "text":
        return ctx.train_ids, {"data": "text"}
    answers = teacher_answers(teacher, ctx.tokenizer, ctx.train_ids, cfg.answers or TeacherAnswers(), seed=ctx.seed,
                              work_dir=ctx.work_dir, log=ctx.log, progress=ctx.progress)
    ids = answers if cfg.data == "teacher_answers" else torch.cat([answers, ctx.train_ids.long()])
    return ids, {"data": cfg.data, "answer_tokens": int(answers.numel()), "train_tokens": int(ids.numel())}


def _blocks(m: nn.Module) -> int:
    return len(decoder_blocks(m))


def hidden_plan(model: nn.Module, teacher: nn.Module, cfg: DistillConfig) -> tuple[dict[int, int], str, int, int]:
    """(student block -> teacher block, how it was derived, student hidden size, teacher hidden size)."""
    n_s, n_t = _blocks(model), _blocks(teacher)
    if not n_s or not n_t:
        raise ValueError(f"distill: hidden_weight needs decoder blocks in both models ({n_s} student, {n_t} teacher)")
    if cfg.layer_map is not None:
        mapping, how = dict(cfg.layer_map), "config"
        bad = {s: t for s, t in mapping.items() if not (0 <= s < n_s and 0 <= t < n_t)}
        if bad:
            raise ValueError(f"distill: layer_map {bad} is out of range: the student has {n_s} blocks, the teacher {n_t}")
    else:
        mapping, how = layer_map(model.config, teacher.config, n_s, n_t)
    if cfg.hidden_layers is not None:
        bad = [i for i in cfg.hidden_layers if i not in mapping]
        if bad:
            raise ValueError(f"distill: hidden_layers {bad} are not student blocks with a teacher match "
                             f"(student blocks: 0..{n_s - 1})")
        mapping = {i: mapping[i] for i in cfg.hidden_layers}
    return mapping, how, int(model.config.hidden_size), int(teacher.config.hidden_size)


def _projection(d_in: int, d_out: int, seed: int, like: torch.Tensor, kept: list[int] | None) -> tuple[nn.Linear, str]:
    """A learned map from the student's hidden size to the teacher's. After a hidden-size prune it
    starts as the identity onto the teacher channels the student kept; otherwise seeded random."""
    proj = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        if kept is not None and len(kept) == d_in and max(kept) < d_out:
            proj.weight.zero_()
            proj.weight[torch.as_tensor(kept), torch.arange(d_in)] = 1.0
            how = "identity on the kept channels"
        else:
            g = torch.Generator().manual_seed(seed)
            proj.weight.copy_(torch.randn(d_out, d_in, generator=g) / d_in**0.5)
            how = "random"
    return proj.to(device=like.device, dtype=like.dtype), how


@register_stage("distill", DistillConfig, uses_baseline=True)
def distill(model: nn.Module, cfg: DistillConfig, ctx: StageContext) -> nn.Module:
    """Knowledge distillation on train text: KL to a teacher (default: the pre-pipeline model), optional CE and hidden-state MSE."""
    teacher = resolve_teacher(model, cfg.teacher, ctx, "distill") if cfg.loss == "distill" or cfg.data != "text" else None
    ids, data = training_text(cfg, ctx, teacher)  # the teacher's answers first, where the stage trains on them
    if cfg.loss != "distill":
        teacher = None
    loss_fn, hidden = None, {}
    if cfg.hidden_weight > 0:
        mapping, how, d_s, d_t = hidden_plan(model, teacher, cfg)
        proj, init = None, None
        if d_s != d_t:
            proj, init = _projection(d_s, d_t, ctx.seed, next(model.parameters()),
                                     kept_hidden(model.config, teacher.config))
        if proj is not None:  # a submodule while training, so the loop's optimizer (and checkpoints) hold it
            model.add_module("distill_projection", proj)
        loss_fn = DistillLoss(teacher, temperature=cfg.temperature, alpha=cfg.alpha, hidden_weight=cfg.hidden_weight,
                              layer_map=mapping, projection=proj, chunk_size=cfg.chunk_size, student=model)
        hidden = {"hidden_weight": cfg.hidden_weight, "layer_map": {str(k): v for k, v in mapping.items()},
                  "layer_map_from": how, "projection": f"learned Linear {d_s}->{d_t}" if proj is not None else None,
                  "projection_init": init}
    try:
        facts = run_training(model, cfg, ctx, teacher, "distill", loss_fn, train_ids=ids)
    finally:
        if loss_fn is not None:
            loss_fn.close()
        model._modules.pop("distill_projection", None)
    del teacher  # a loaded teacher is freed with the stage
    ctx.details.update(
        {
            "teacher": cfg.teacher.model_dump(mode="json") if cfg.teacher is not None else "baseline (pre-pipeline model)",
            "temperature": cfg.temperature,
            "alpha": cfg.alpha,
            **data,
            **hidden,
            "grad_accum_steps": cfg.batch.grad_accum_steps,
            "micro_batch_size": cfg.batch.micro_batch_size,
            **facts,
        }
    )
    return model
