"""``checks.arm64``: verify each export row in the ARM64 build of its runtime (docs/devices.md).

Kept apart from :mod:`optimize.checks.arm64` so the config imports no runtime."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from targets.config_base import Strict

#: the emulated cores (targets.arm64.cpus.CPUS; literal here so a typo is refused with the list)
CpuName = Literal["cortex-a72", "cortex-a76", "max"]


class Arm64Check(Strict):
    """Run every export row's artifact under QEMU on each core in ``cpus``: greedy tokens equal to
    the x86-64 runtime's (or first diverging at a near-tie) and perplexity within
    ``ppl_tolerance_pct``; a failure fails the row's ``arm64`` gate (``gates.on_fail`` decides whether
    that stops the run)."""

    cpus: list[CpuName] | None = Field(
        None, min_length=1, description="emulated cores (cortex-a72, cortex-a76, max = Armv9 with SME off); default: "
        "the device profile's core, else cortex-a76")
    prompts: int = Field(2, ge=0, description="greedy prompts, cut from the run's latency prompt")
    prompt_tokens: int = Field(32, ge=1, description="tokens per prompt")
    new_tokens: int = Field(16, ge=1, description="greedy tokens per prompt")
    windows: int = Field(24, ge=0, description="perplexity windows of window_tokens, cut in order from the run's "
                         "evaluation windows. Fewer make the 1% tolerance noise: a 4-bit model's two builds differ by a "
                         "few percent a window either way (SmolLM2 on the GGUF grid: +1.61% on 8 windows, +0.72% on 24, "
                         "standard error 0.55%); the report gives the standard error of each comparison")
    window_tokens: int = Field(128, ge=8, description="tokens per window (the emulator runs about 100x slower)")
    ppl_tolerance_pct: float = Field(1.0, gt=0, description="largest perplexity difference from x86-64, percent")
