"""AWQ-style activation-aware scaling for 4-bit weights, folded exactly into norms/linears.

Place it before a ``ptq_int8`` stage with the same scheme, group size and weight_qparams: this
stage only rescales fp32 weights (the model's logits are unchanged to float rounding), so
the quantizer that follows, and the .pte it lowers to, are the ordinary torchao
``IntxUnpackedToInt8Tensor`` layout XNNPACK already handles. Per group the exponent is
searched on calibration rows with the shipped scheme's fake-quant numerics; ``alpha = 0``
(round-to-nearest) is in the grid, so a group is only rescaled where it measurably helps.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator
from torch import nn

from optimize.stage_api import StageConfig, StageContext, register_stage

#: ptq_int8's weight_qparams -> the fake-quant algorithm with the same numerics
_ALGO = {"affine": "rtn", "hqq_scale_only": "hqq"}


class AwqConfig(StageConfig):
    kind: Literal["awq"] = "awq"
    scheme: Literal["8da4w", "w4", "8da8w"] = Field(
        "8da4w",
        description="the scheme the following quantization stage applies (its numerics drive the search): "
        "8da4w (int8 dynamic activations, int4 groups), w4 (int4 weights only), 8da8w",
    )
    group_size: int = Field(32, gt=0, description="int4 group size of the following quantization; a multiple of 32")
    weight_qparams: Literal["affine", "hqq_scale_only"] = Field(
        "affine",
        description="weight scale choice of the following ptq_int8 stage (its weight_qparams): affine "
        "(round-to-nearest from each group's max) or hqq_scale_only (HQQ least-squares scales)",
    )
    folds: list[Literal["qkv", "gate_up", "down", "o"]] = Field(
        default_factory=lambda: ["qkv", "gate_up", "down", "o"],
        min_length=1,
        description="equalization groups to search (qkv, gate_up, down, o); all folds are exact in fp32",
    )
    rows: int = Field(512, ge=16, le=8192, description="calibration rows per group the error is measured on")
    grid: int = Field(11, ge=2, le=41, description="exponents tried per group, evenly spaced in [0, 1]")
    calibration_windows: int = Field(4, ge=1, description="at most this many calibration windows are run")
    keep_high_precision: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="module patterns the following stage leaves fp32 (their error is not counted); "
        "match ptq_int8's keep_high_precision",
    )

    needs_calibration: ClassVar[bool] = True

    @field_validator("group_size")
    @classmethod
    def _multiple(cls, v: int) -> int:
        if v % 32:
            raise ValueError(f"group_size={v} is not a multiple of 32 (XNNPACK's 4-bit kernels need 32-channel blocks)")
        return v

    @field_validator("folds")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"folds {v} lists a fold twice")
        return v


@register_stage("awq", AwqConfig)
def awq(model: nn.Module, cfg: AwqConfig, ctx: StageContext) -> nn.Module:
    """Activation-aware (AWQ) per-channel scaling for int4 weights, searched on calibration text and folded exactly."""
    from optimize.quant.awq import awq_scale
    from optimize.quant.fakequant import scheme_for
    from optimize.stages._select import select_modules, unmatched_patterns

    if not ctx.calibration:
        raise ValueError("awq needs calibration text; set data.calibration_tokens > 0")
    typos = unmatched_patterns(model, cfg.keep_high_precision)
    if typos:
        raise ValueError(f"awq: keep_high_precision pattern(s) {typos} match no module of {type(model).__name__}")
    skip_sel, _ = select_modules(model, nn.Linear, include=cfg.keep_high_precision) if cfg.keep_high_precision else ([], [])
    windows = ctx.calibration[: cfg.calibration_windows]
    grid = tuple(i / (cfg.grid - 1) for i in range(cfg.grid))
    was_training = model.training
    model.eval()
    res = awq_scale(model, windows, scheme_for(cfg.scheme, cfg.group_size, _ALGO[cfg.weight_qparams]), folds=tuple(cfg.folds),
                    rows=cfg.rows, grid=grid, skip=frozenset(skip_sel))
    model.train(was_training)
    alphas = list(res.alphas.values())
    ctx.details.update(
        {
            "scheme": cfg.scheme,
            "group_size": cfg.group_size,
            "weight_qparams": cfg.weight_qparams,
            "groups": res.groups,
            "groups_rescaled": sum(a > 0 for a in alphas),
            "mean_alpha": round(sum(alphas) / max(len(alphas), 1), 3),
            "calibration_output_error_reduction": round(res.error_reduction, 4),
            "fold": "exact (norm / linear weights rescaled; no extra ops)",
        }
    )
    ctx.log(f"awq: {res.groups} groups, {sum(a > 0 for a in alphas)} rescaled; calibration output error "
            f"-{100 * res.error_reduction:.1f}% vs round-to-nearest")
    return model
