"""Test-only stages, loaded through OPTIMIZE_PLUGINS (the same way users add their own)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from optimize.stage_api import StageConfig, register_stage


class NoiseConfig(StageConfig):
    kind: Literal["test_noise"] = "test_noise"
    scale: float = Field(0.01, ge=0, description="std of the Gaussian noise added to every weight")


@register_stage("test_noise", NoiseConfig)
def test_noise(model, cfg: NoiseConfig, ctx):
    """Add Gaussian weight noise (test only: a stage with a controllable accuracy cost)."""
    g = torch.Generator().manual_seed(ctx.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * cfg.scale).to(p.device, p.dtype))
    ctx.details["scale"] = cfg.scale
    return model


class WhereConfig(StageConfig):
    kind: Literal["test_where"] = "test_where"


@register_stage("test_where", WhereConfig)
def test_where(model, cfg: WhereConfig, ctx):
    """Record where the stage ran (test only: the context's device and dtype, and the model's)."""
    p = next(model.parameters())
    ctx.details.update({"ctx_device": str(ctx.device), "ctx_dtype": str(ctx.dtype),
                        "model_device": str(p.device), "model_dtype": str(p.dtype),
                        "baseline_model": ctx.baseline_model is not None})
    return model


class SleepConfig(StageConfig):
    kind: Literal["test_sleep"] = "test_sleep"
    seconds: float = Field(0.0, ge=0, description="how long to sleep")
    marker: str | None = Field(None, description="file touched when the stage starts")


@register_stage("test_sleep", SleepConfig)
def test_sleep(model, cfg: SleepConfig, ctx):
    """Sleep (test only: gives a test time to kill the run mid-stage)."""
    if cfg.marker:
        Path(cfg.marker).write_text("started")
    time.sleep(cfg.seconds)
    return model


class BoomConfig(StageConfig):
    kind: Literal["test_boom"] = "test_boom"
    in_check: bool = Field(False, description="raise in the pre-flight check instead of in the stage")

    def check_model(self, config, target):
        if self.in_check:
            raise KeyError("boom in check_model")
        return []


@register_stage("test_boom", BoomConfig)
def test_boom(model, cfg: BoomConfig, ctx):
    """Raise (test only: a stage that crashes)."""
    raise RuntimeError("boom: this stage always fails")
