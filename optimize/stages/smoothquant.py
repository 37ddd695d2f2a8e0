"""SmoothQuant: migrate activation outliers into weights, folded exactly into the preceding
norm (or linear), before a W8A8 quantization (ORT static/dynamic QDQ, XNNPACK 8da8w).

The model stays fp32 and computes the same logits (to float rounding), so the stage can sit
anywhere before the quantizer: a ``ptq_int8`` stage for ExecuTorch, or the ORT exporter's
``quantize: static|dynamic`` option. Folds (see :mod:`optimize.quant.equalize`): ``qkv``
(input_layernorm -> q/k/v_proj), ``gate_up`` (the MLP's pre-norm -> gate/up_proj),
``down`` (up_proj rows -> down_proj; exact because act(gate) * up is linear in up) and
``o`` (v_proj rows -> o_proj, GQA-aware; exact because attention is linear in V).

Supported layouts (Llama, Mistral, Qwen2/3, Phi-3's fused projections, Gemma's ``1 + w``
norms and Gemma2/3's pre-feedforward norm) are in :mod:`optimize.quant.fold_layouts`; other
architectures are refused at validation. After folding, the logits on calibration windows
are compared with the model's before (``exactness``), and a fold that is not exact stops the run.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from torch import nn

from optimize.quant.smoothquant import smooth
from optimize.rewrites.exactness import ExactnessConfig, ExactnessProbe, probe_windows
from optimize.stage_api import StageConfig, StageContext, register_stage
from optimize.stages._preflight import fold_problems, split_experts


class SmoothQuantConfig(StageConfig):
    kind: Literal["smoothquant"] = "smoothquant"
    alpha: float = Field(
        0.5, ge=0.0, le=1.0,
        description="migration strength: s = max|X|^alpha / max|W|^(1-alpha); 0 = no change, 1 = all "
        "of the activation range moved into the weights (0.5 is the paper's default for Llama-like models)",
    )
    folds: list[Literal["qkv", "gate_up", "down", "o"]] = Field(
        default_factory=lambda: ["qkv", "gate_up", "down", "o"],
        min_length=1,
        description="where to fold: qkv (input_layernorm), gate_up (the MLP's pre-norm: post_attention_layernorm, "
        "pre_feedforward_layernorm in Gemma2/3), down (up_proj -> down_proj) and o (v_proj -> o_proj); all are "
        "exact in fp32",
    )
    calibration_windows: int = Field(
        8, ge=1, description="at most this many calibration windows are used to measure activation ranges"
    )
    exactness: ExactnessConfig = Field(
        default_factory=ExactnessConfig,
        description="how the fold is proven exact: logits before vs after on calibration windows; the "
        "stage refuses a model whose logits move more than the tolerance",
    )

    @field_validator("folds")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"folds {v} lists a fold twice")
        return v

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        return fold_problems(config, self.folds)


@register_stage("smoothquant", SmoothQuantConfig, restore=split_experts)
def smoothquant(model: nn.Module, cfg: SmoothQuantConfig, ctx: StageContext) -> nn.Module:
    """SmoothQuant outlier migration for W8A8, folded exactly into norms/linears (no run-time cost)."""
    if not ctx.calibration:
        raise ValueError("smoothquant needs calibration text; set data.calibration_tokens > 0")
    split_experts(model)
    windows = ctx.calibration[: cfg.calibration_windows]
    was_training = model.training
    model.eval()
    probe = ExactnessProbe.before(model, probe_windows(ctx.calibration, cfg.exactness), cfg.exactness)
    res = smooth(model, windows, alpha=cfg.alpha, folds=tuple(cfg.folds))
    exact = probe.after(model, f"smoothquant (folds {', '.join(cfg.folds)})")
    model.train(was_training)
    ctx.details.update(
        {
            "alpha": cfg.alpha,
            "folds": list(cfg.folds),
            "fold_groups": res.groups,
            "calibration_windows": len(windows),
            "activation_outlier_ratio_before": round(res.outlier_ratio_before, 2),
            "activation_outlier_ratio_after": round(res.outlier_ratio_after, 2),
            "scale_range": [round(x, 5) for x in res.scale_range],
            "fold": "exact (norm / linear weights rescaled; no extra ops)",
            "exactness": exact,
        }
    )
    ctx.log(
        f"smoothquant alpha={cfg.alpha}: {res.groups} groups folded; activation max/median "
        f"{res.outlier_ratio_before:.1f} -> {res.outlier_ratio_after:.1f}"
    )
    return model

