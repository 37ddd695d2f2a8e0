"""AWQ-style activation-aware scaling for 4-bit weights, folded exactly into norms/linears.

Place it before a ``ptq_int8`` stage with the same scheme, group size and weight_qparams: this
stage only rescales fp32 weights (the model's logits are unchanged to float rounding), so
the quantizer that follows, and the .pte it lowers to, are the ordinary torchao
``IntxUnpackedToInt8Tensor`` layout XNNPACK already handles. Per group the exponent is
searched on calibration rows with the shipped scheme's fake-quant numerics; ``alpha = 0``
(round-to-nearest) is in the grid, so a group is only rescaled where it measurably helps.
The architectures it folds into are those of :mod:`optimize.quant.fold_layouts` (others are
refused at validation), and the fold is proven on calibration windows (``exactness``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from torch import nn

from optimize.module_select import select_modules, unmatched_patterns
from optimize.quant.awq import awq_scale
from optimize.quant.equalize import fold_groups
from optimize.quant.fakequant import scheme_for
from optimize.quant.host_independent import DESCRIPTION as CALIBRATION_DTYPE, CalibrationDtype, calibrating_in, resolve
from optimize.rewrites.exactness import ExactnessConfig, ExactnessProbe, probe_windows
from optimize.stage_api import StageConfig, StageContext, register_stage
from optimize.stages._preflight import fold_problems, split_experts, with_meta_model
from targets.group_size import group_size_error, widths_error

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
    calibration_dtype: CalibrationDtype = Field("auto", description=CALIBRATION_DTYPE)
    exactness: ExactnessConfig = Field(
        default_factory=ExactnessConfig,
        description="how the fold is proven exact: logits before vs after on calibration windows; the "
        "stage refuses a model whose logits move more than the tolerance",
    )

    @field_validator("group_size")
    @classmethod
    def _multiple(cls, v: int) -> int:
        why = group_size_error(v)
        if why:
            raise ValueError(why)
        return v

    @field_validator("folds")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"folds {v} lists a fold twice")
        return v

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        problems = fold_problems(config, self.folds)
        if problems or self.scheme == "8da8w":
            return problems
        return with_meta_model(config, self._group_size_problems, split_experts=True)

    def _group_size_problems(self, model: nn.Module) -> list[str]:
        """The int4 search fake-quantizes every searched reader in groups of group_size."""
        typos = unmatched_patterns(model, self.keep_high_precision)
        if typos:
            return [f"keep_high_precision pattern(s) {typos} match no module of {type(model).__name__}"]
        skip = set(select_modules(model, nn.Linear, include=self.keep_high_precision)[0]) if self.keep_high_precision else set()
        mods = dict(model.named_modules())
        widths = {n: mods[n].in_features for g in fold_groups(model, tuple(self.folds)) for n in g.linears if n not in skip}
        why = widths_error(self.group_size, widths)
        return [why] if why else []


@register_stage("awq", AwqConfig, restore=split_experts)
def awq(model: nn.Module, cfg: AwqConfig, ctx: StageContext) -> nn.Module:
    """Activation-aware (AWQ) per-channel scaling for int4 weights, searched on calibration text and folded exactly."""
    if not ctx.calibration:
        raise ValueError("awq needs calibration text; set data.calibration_tokens > 0")
    split_experts(model)
    typos = unmatched_patterns(model, cfg.keep_high_precision)
    if typos:
        raise ValueError(f"awq: keep_high_precision pattern(s) {typos} match no module of {type(model).__name__}")
    skip_sel, _ = select_modules(model, nn.Linear, include=cfg.keep_high_precision) if cfg.keep_high_precision else ([], [])
    windows = ctx.calibration[: cfg.calibration_windows]
    grid = tuple(i / (cfg.grid - 1) for i in range(cfg.grid))
    was_training = model.training
    model.eval()
    probe = ExactnessProbe.before(model, probe_windows(ctx.calibration, cfg.exactness), cfg.exactness)
    with calibrating_in(model, resolve(model, cfg.calibration_dtype, ctx.device)) as calib_dtype:
        res = awq_scale(model, windows, scheme_for(cfg.scheme, cfg.group_size, _ALGO[cfg.weight_qparams]),
                        folds=tuple(cfg.folds), rows=cfg.rows, grid=grid, skip=frozenset(skip_sel))
    exact = probe.after(model, f"awq (folds {', '.join(cfg.folds)})")
    model.train(was_training)
    alphas = list(res.alphas.values())
    ctx.details.update(
        {
            "scheme": cfg.scheme,
            "group_size": cfg.group_size,
            "weight_qparams": cfg.weight_qparams,
            "calibration_dtype_used": calib_dtype,
            "groups": res.groups,
            "groups_rescaled": sum(a > 0 for a in alphas),
            "mean_alpha": round(sum(alphas) / max(len(alphas), 1), 3),
            "calibration_output_error_reduction": round(res.error_reduction, 4),
            "fold": "exact (norm / linear weights rescaled; no extra ops)",
            "exactness": exact,
        }
    )
    ctx.log(f"awq: {res.groups} groups, {sum(a > 0 for a in alphas)} rescaled; calibration output error "
            f"-{100 * res.error_reduction:.1f}% vs round-to-nearest")
    return model
