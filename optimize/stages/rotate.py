"""Rotate: fold orthogonal rotations into the weights so 4-bit groups and int8 tokens see no outliers.

Put it before the quantization stages (``rotate -> awq -> ptq_int8``). R1 rotates the residual
stream, R2 each attention head's values (see :mod:`optimize.quant.rotate` for the algebra and
what is refused). The rotated model is an ordinary model of the same architecture, exported
unchanged by every target, and computes the same logits: the stage proves it on calibration
text (``exactness``) and refuses otherwise. A tied embedding is untied when the final norm's
weight would have to enter the lm_head (the report says so and how many bytes that adds).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field, model_validator
from torch import nn

from optimize.quant.rotate import plan_rotation, rotate_model
from optimize.rewrites.exactness import ExactnessConfig, ExactnessProbe, probe_windows
from optimize.stage_api import StageConfig, StageContext, register_stage
from optimize.stages._preflight import on_fold_layout, split_experts


class RotateConfig(StageConfig):
    kind: Literal["rotate"] = "rotate"
    r1: bool = Field(True, description="rotate the residual stream (norm weights folded into their readers first)")
    r2: bool = Field(True, description="rotate each attention head's values (v_proj rows, o_proj columns)")
    matrix: Literal["hadamard", "random"] = Field(
        "hadamard",
        description="hadamard: a randomized Hadamard matrix where torchao has one of that width (else a random "
        "orthogonal one, and the report says so); random: a seeded random orthogonal matrix",
    )
    seed: int = Field(0, description="seed of the random signs / random matrix (R2 uses seed + 1)")
    tied: Literal["untie", "refuse"] = Field(
        "untie",
        description="a tied embedding whose final norm is not the identity cannot stay tied under R1: untie "
        "(the lm_head gets its own weight; the report gives the bytes) or refuse",
    )
    exactness: ExactnessConfig = Field(
        default_factory=ExactnessConfig,
        description="how the rotation is proven exact: logits before vs after on calibration windows",
    )

    @model_validator(mode="after")
    def _something(self) -> "RotateConfig":
        if not (self.r1 or self.r2):
            raise ValueError("r1 and r2 are both false: the stage would do nothing; enable one or drop the stage")
        return self

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        def check(model: nn.Module) -> list[str]:
            plan = plan_rotation(model, self.r1, self.r2)
            if self.r1 and plan.r1_refused:
                return [f"R1 (residual stream) cannot be exact here: {plan.r1_refused}; set r1: false to apply R2 only"]
            if self.r1 and self.tied == "refuse" and getattr(config, "tie_word_embeddings", False):
                return ["the embedding is tied to the lm_head: R1 unties it unless the final norm's weight is all "
                        "ones, and tied: refuse forbids that (set tied: untie, or r1: false)"]
            return []

        return on_fold_layout(config, check)

    def planned_config(self, config: Any) -> Any:
        """R1 unties a tied embedding (the later stages see an untied model); the run confirms
        whether the final norm allowed the tie to stay."""
        if not (self.r1 and self.tied == "untie" and getattr(config, "tie_word_embeddings", False)):
            return config
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False
        return config


@register_stage("rotate", RotateConfig, restore=split_experts)
def rotate(model: nn.Module, cfg: RotateConfig, ctx: StageContext) -> nn.Module:
    """Exact Hadamard rotations (R1 residual stream, R2 per head) folded into the weights, for 4-bit."""
    split_experts(model)
    plan = plan_rotation(model, cfg.r1, cfg.r2)
    was_training = model.training
    model.eval()
    probe = ExactnessProbe.before(model, probe_windows(ctx.calibration, cfg.exactness,
                                                       vocab=getattr(model.config, "vocab_size", None)),
                                  cfg.exactness)
    res = rotate_model(model, plan, r1=cfg.r1, r2=cfg.r2, matrix=cfg.matrix, seed=cfg.seed, tied=cfg.tied)
    what = " and ".join(x for x, on in (("R1", cfg.r1), ("R2", cfg.r2)) if on)
    exact = probe.after(model, f"rotate ({what})")
    model.train(was_training)
    ctx.details.update({
        "r1": res.r1,
        "r2": res.r2,
        "hidden": plan.hidden,
        "head_dim": plan.head_dim,
        "norms_folded": res.norms_folded,
        "linears_rotated": res.linears_rotated,
        "untied_embeddings": res.untied,
        "untied_bytes": res.untied_bytes,
        "tie_kept": res.tie_kept,
        "fold": "exact (weights rotated; no extra ops)",
        "exactness": exact,
    })
    msg = f"rotate {what}: {res.linears_rotated} linears, {res.norms_folded} norms folded"
    if res.untied:
        msg += f"; embedding untied from the lm_head (+{res.untied_bytes / 2**20:.1f} MiB before quantization)"
    ctx.log(msg)
    return model
