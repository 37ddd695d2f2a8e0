"""Optimize causal LMs through typed, gated stages and export them verified.

    from optimize import load_config, run_pipeline
    report = run_pipeline(load_config("model.yaml"), target="executorch")

Attributes are imported lazily so ``import optimize`` has no side effects and stays fast.
"""

from __future__ import annotations

__all__ = ["load_config", "run_pipeline", "PipelineConfig", "Report", "register_stage", "StageConfig", "StageContext"]


def __getattr__(name: str):
    if name in ("load_config", "PipelineConfig"):
        from optimize import config

        return getattr(config, name)
    if name == "run_pipeline":
        from optimize.pipeline import run_pipeline

        return run_pipeline
    if name == "Report":
        from optimize.report import Report

        return Report
    if name in ("register_stage", "StageConfig", "StageContext"):
        from optimize import stage_api

        return getattr(stage_api, name)
    raise AttributeError(f"module 'optimize' has no attribute {name!r}")
