"""Quantization-aware training with torchao for the XNNPACK schemes ``8da8w`` and ``8da4w``.

``quantize_(m, QATConfig(base, step="prepare"))`` swaps the selected nn.Linear layers for
fake-quantized ones (int8 dynamic per-token activations, int8/int4 symmetric weights, the
numerics of ``base``), the model is fine-tuned on ``ctx.train_ids`` so the weights adapt to
the rounding, and ``QATConfig(base, step="convert")`` swaps them back and applies ``base``
itself. ``base`` is exactly the torchao config ``ptq_int8`` builds (:func:`linear_config`),
and the layer selection is ``ptq_int8``'s :func:`plan`, so the output is the same
``IntxUnpackedToInt8Tensor`` layout and exports to ExecuTorch/XNNPACK the same way.
``torch.ao.quantization.convert`` must not be used instead: it silently ruins accuracy.

By default the fine-tune distils from ``ctx.baseline_model`` (the fp32 model as it entered
the pipeline), which targets the quantity the gates measure (KL/top-1 to the baseline);
``loss: lm`` trains on next-token cross-entropy alone.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator
from torch import nn

from optimize.stage_api import StageContext, register_stage
from optimize.stages._select import is_tied
from optimize.stages.distill import TrainingStageConfig, resolve_teacher, run_training
from optimize.stages.ptq_int8 import Ptq8Config, _untie_config, linear_config, plan


class QatConfig(TrainingStageConfig):
    kind: Literal["qat"] = "qat"
    scheme: Literal["8da8w", "8da4w"] = Field(
        "8da8w",
        description="8da8w: dynamic int8 activations, int8 per-channel weights; "
        "8da4w: dynamic int8 activations, int4 group-wise weights (where QAT helps most)",
    )
    group_size: int | None = Field(
        None, gt=0, description="8da4w only: input channels per int4 weight group, a multiple of 32 (as ptq_int8)"
    )
    keep_high_precision: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="module-name fnmatch patterns (or 'lm_head', 'embeddings') left fp32, as in ptq_int8",
    )
    modules: list[str] | None = Field(
        None, min_length=1, description="fnmatch patterns restricting which nn.Linear layers are quantized"
    )

    @model_validator(mode="after")
    def _valid_as_ptq(self) -> "QatConfig":
        self.ptq_config()
        return self

    def ptq_config(self) -> Ptq8Config:
        """The equivalent ptq_int8 config: same validation, same torchao base config, same selection."""
        try:
            return Ptq8Config(
                scheme=self.scheme,
                group_size=self.group_size,
                keep_high_precision=list(self.keep_high_precision),
                modules=list(self.modules) if self.modules is not None else None,
            )
        except ValidationError as exc:
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None

    def quant_scheme(self) -> str:
        return self.scheme


@register_stage("qat", QatConfig)
def qat(model: nn.Module, cfg: QatConfig, ctx: StageContext) -> nn.Module:
    """Quantization-aware training (torchao QATConfig prepare -> fine-tune -> convert) to 8da8w/8da4w."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    pcfg = cfg.ptq_config()
    try:
        p = plan(model, pcfg)
    except ValueError as exc:
        raise ValueError(str(exc).replace("ptq_int8:", "qat:", 1)) from None
    teacher = resolve_teacher(model, None, ctx, "qat") if cfg.loss == "distill" else None
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    was_tied = is_tied(in_emb, out_emb)

    base = linear_config(pcfg)
    selected = set(p["selected"])
    only_selected = lambda m, fqn: isinstance(m, nn.Linear) and fqn in selected  # noqa: E731
    quantize_(model, QATConfig(base, step="prepare"), filter_fn=only_selected)
    facts = run_training(model, cfg, ctx, teacher, "qat")
    quantize_(model, QATConfig(base, step="convert"), filter_fn=only_selected)

    untied = was_tied and not is_tied(in_emb, out_emb)
    if untied:
        _untie_config(model)
    ctx.details.update(
        {
            "scheme": cfg.scheme,
            "group_size": pcfg.effective_group_size,
            "weight_bits": 8 if cfg.scheme == "8da8w" else 4,
            "activations": "int8 dynamic per-token (fake-quantized during training)",
            "loss": cfg.loss,
            "temperature": cfg.temperature if cfg.loss == "distill" else None,
            "alpha": cfg.alpha,
            "linear_quantized": len(p["selected"]),
            "linear_kept": len(p["kept"]),
            "kept_modules": p["kept"],
            "untied_embeddings": untied,
            **facts,
        }
    )
    ctx.log(
        f"qat {cfg.scheme}: {len(p['selected'])} Linear layers fake-quantized, loss "
        f"{facts['loss_first']:.4f} -> {facts['loss_last']:.4f} in {cfg.steps} steps, converted"
    )
    return model
