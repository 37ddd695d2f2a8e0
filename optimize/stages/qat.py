"""Quantization-aware training with torchao for the XNNPACK schemes ``8da8w`` and ``8da4w``.

``quantize_(m, QATConfig(base, step="prepare"))`` swaps the selected nn.Linear layers for
fake-quantized ones (int8 dynamic per-token activations, int8/int4 symmetric weights, the
numerics of ``base``), the model is fine-tuned on ``ctx.train_ids`` so the weights adapt to
the rounding, and ``QATConfig(base, step="convert")`` swaps them back and applies ``base``
itself. ``base`` is exactly the torchao config ``ptq_int8`` builds (:func:`linear_config`),
and the layer selection is ``ptq_int8``'s (:meth:`Ptq8Config.layer_plan`), so the output is the same
``IntxUnpackedToInt8Tensor`` layout and exports to ExecuTorch/XNNPACK the same way.
``torch.ao.quantization.convert`` must not be used instead: it silently ruins accuracy.

By default the fine-tune distils from ``ctx.baseline_model`` (the fp32 model as it entered
the pipeline), which targets the quantity the gates measure (KL/top-1 to the baseline);
``loss: lm`` trains on next-token cross-entropy alone.

The scheme comes from the target when not given (:meth:`QatConfig.resolved_scheme`): the
scheme its export options name, else 8da4w (where QAT recovers most) if the target runs it,
else 8da8w. A scheme the target does not run, or one that contradicts the target's export
quantization, is refused before any stage runs (:meth:`QatConfig.check_model`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from torch import nn

from optimize.stage_api import StageContext, register_stage
from optimize.stages._preflight import split_experts
from optimize.module_select import is_tied
from optimize.stages.distill import TrainingStageConfig, resolve_teacher, run_training
from optimize.stages.ptq_config import Ptq8Config
from optimize.stages.ptq_int8 import linear_config
from optimize.stages.ptq_plan import untie_config


class QatConfig(TrainingStageConfig):
    kind: Literal["qat"] = "qat"
    scheme: Literal["8da8w", "8da4w"] | None = Field(
        None,
        description="8da8w: dynamic int8 activations, int8 per-channel weights; "
        "8da4w: dynamic int8 activations, int4 group-wise weights (where QAT helps most); "
        "null: the target's (its export quantization, else 8da4w if it runs it, else 8da8w; no target: 8da4w)",
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
    int8_modules: list[str] = Field(
        default_factory=list,
        description="8da4w only: module patterns (or 'lm_head') trained and quantized 8da8w instead of int4, "
        "as ptq_int8's int8_modules (e.g. [lm_head] with keep_high_precision: [])",
    )

    @model_validator(mode="after")
    def _valid_as_ptq(self) -> "QatConfig":
        self.ptq_config()
        return self

    def resolved_scheme(self, target: Any | None = None) -> str:
        """The scheme the stage trains for: given, else the target's (see the module docstring)."""
        if self.scheme is not None:
            return self.scheme
        if target is not None:
            named = (getattr(target, "export_options", None) or {}).get("quantize")
            if named in ("8da4w", "8da8w"):
                return named
            for scheme in ("8da4w", "8da8w"):
                if target.check_scheme(scheme) is None:
                    return scheme
        return "8da4w"

    def ptq_config(self, target: Any | None = None) -> Ptq8Config:
        """The equivalent ptq_int8 config: same validation, same torchao base config, same selection."""
        scheme = self.resolved_scheme(target)
        try:
            return Ptq8Config(
                scheme=scheme,
                group_size=self.group_size if scheme == "8da4w" or self.scheme is not None else None,
                keep_high_precision=list(self.keep_high_precision),
                modules=list(self.modules) if self.modules is not None else None,
                int8_modules=list(self.int8_modules) if scheme == "8da4w" or self.scheme is not None else [],
            )
        except ValidationError as exc:
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None

    def quant_scheme(self) -> str:
        return self.resolved_scheme(None)

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        """The target must run the scheme and export it as trained; the layer selection and group
        size must fit the model (ptq_int8's own checks, on the scheme resolved for the target)."""
        scheme = self.resolved_scheme(target)
        problems = []
        if target is not None:
            why = target.check_scheme(scheme)
            if why:
                problems.append(why)
            named = (getattr(target, "export_options", None) or {}).get("quantize")
            if named not in (None, "none", scheme):
                problems.append(f"scheme {scheme} does not match target {target.name!r}, whose export quantizes "
                                f"to {named}; QAT must train for the scheme that ships (set scheme: {named})")
        if self.scheme is None and scheme == "8da8w" and (self.group_size is not None or self.int8_modules):
            problems.append("group_size and int8_modules apply to 8da4w, but the target resolves the scheme to 8da8w")
        if problems:
            return problems
        try:
            pcfg = self.ptq_config(target)
        except ValueError as exc:
            return [str(exc)]
        return [m.replace("ptq_int8", "qat") for m in pcfg.check_model(config, target)]


def _only(names: set[str]):
    return lambda m, fqn: isinstance(m, nn.Linear) and fqn in names


@register_stage("qat", QatConfig, uses_baseline=True, restore=split_experts)
def qat(model: nn.Module, cfg: QatConfig, ctx: StageContext) -> nn.Module:
    """Quantization-aware training (torchao QATConfig prepare -> fine-tune -> convert) to 8da4w/8da8w; scheme from the target unless given."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    scheme = cfg.resolved_scheme(ctx.target)
    if ctx.target is not None:
        problems = cfg.check_model(model.config, ctx.target)
        if problems:
            raise ValueError("qat: " + "; ".join(problems))
    pcfg = cfg.ptq_config(ctx.target)
    split_experts(model)  # as ptq_int8 does: a mixture's experts are trained and quantized as Linears
    try:
        p = pcfg.layer_plan(model)
    except ValueError as exc:
        raise ValueError(str(exc).replace("ptq_int8:", "qat:", 1)) from None
    teacher = resolve_teacher(model, None, ctx, "qat") if cfg.loss == "distill" else None
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    was_tied = is_tied(in_emb, out_emb)

    eight = set(p["int8"]) if scheme == "8da4w" else set()
    groups = [(linear_config(pcfg), set(p["selected"]) - eight)]
    if eight:
        groups.append((linear_config(pcfg.model_copy(update={"scheme": "8da8w", "group_size": None})), eight))
    ctx.progress(phase="prepare", event="begin", message=f"qat: fake-quantizing {len(p['selected'])} Linear layers")
    for base, names in groups:
        quantize_(model, QATConfig(base, step="prepare"), filter_fn=_only(names))
    ctx.progress(phase="prepare", event="end")
    facts = run_training(model, cfg, ctx, teacher, "qat")  # progress: phase "train", one event per step
    ctx.progress(phase="convert", event="begin", message=f"qat: converting to {scheme}")
    for base, names in groups:
        quantize_(model, QATConfig(base, step="convert"), filter_fn=_only(names))
    ctx.progress(phase="convert", event="end")

    untied = was_tied and not is_tied(in_emb, out_emb)
    if untied:
        untie_config(model)
    ctx.details.update(
        {
            "scheme": scheme,
            "scheme_from": "config" if cfg.scheme is not None else ("target" if ctx.target is not None else "default"),
            "int8_modules": sorted(eight),
            "group_size": pcfg.effective_group_size,
            "weight_bits": 8 if scheme == "8da8w" else 4,
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
        f"qat {scheme}: {len(p['selected'])} Linear layers fake-quantized, loss "
        f"{facts['loss_first']:.4f} -> {facts['loss_last']:.4f} in {cfg.steps} steps, converted"
    )
    return model
