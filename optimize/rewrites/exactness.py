"""Prove a fold that claims to be exact: logits on calibration text before and after.

``smoothquant``, ``awq`` and ``rmsnorm`` rewrite weights in ways that compute the same
function in exact arithmetic. Each records reference logits on a few calibration windows
before it folds (:meth:`ExactnessProbe.before`) and compares after (:meth:`ExactnessProbe.after`),
refusing with :class:`FoldNotExact` when the largest logit difference, relative to the largest
reference logit, exceeds the tolerance: a fold applied to a layout it does not understand
(a Gemma ``x * (1 + w)`` norm scaled like ``x * w``, a post-norm taken for a pre-norm) then
stops the run instead of passing with a broken model.

Why the default tolerance is 1e-4: folding rounds every rescaled weight to fp32 once, and the
model's own fp32 arithmetic then differs by rounding. Measured on the real SmolLM2-135M in fp32
(2 calibration windows x 256 pydoc tokens, largest |logit| 41.3; ``bench/fold_exactness.py``),
the largest logit moved by 7e-5..1e-4, i.e. 1.7e-6..2.4e-6 of the logit scale (smoothquant
alpha 0.5 and 0.8 with every fold, awq 8da4w), so 1e-4 leaves a margin of ~40x, while a wrong
fold moves logits by tens of percent of their scale (0.55 for a Gemma2 norm folded as ``w / s``).
Models in bf16/fp16 round far more (SmolLM2 in bf16: 0.026..0.039 relative for the same folds):
the tolerance then scales with the dtype's epsilon (``eps(dtype) / eps(float32)``), capped at 0.1,
and the report says so; that still refuses a grossly wrong fold but not a subtle one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field
from torch import nn

from targets.config_base import Strict

#: relative max-abs logit difference an fp32 fold may show (see the module docstring)
DEFAULT_TOLERANCE = 1e-4
#: the most a low-precision model's scaled tolerance may grow to (still catches a wrong fold)
MAX_SCALED_TOLERANCE = 0.1


class FoldNotExact(RuntimeError):
    """A fold that claims exactness changed the model's logits beyond the tolerance."""


class ExactnessConfig(Strict):
    """How a stage that claims an exact fold proves it (logits before vs after, on calibration text)."""

    windows: int = Field(2, ge=1, le=16, description="calibration windows the logits are compared on")
    tokens: int = Field(
        256, ge=8, le=8192,
        description="tokens of each window compared (the window's first tokens; bounds the memory the "
        "reference logits take: windows x tokens x vocab floats)",
    )
    tolerance: float = Field(
        DEFAULT_TOLERANCE, gt=0, le=1,
        description="largest allowed max|logit after - logit before| / max|logit before| in fp32; "
        "fp32 rounding of a correct fold measured 1.7e-6..2.4e-6 on SmolLM2-135M",
    )


def probe_windows(calibration: list[torch.Tensor], cfg: ExactnessConfig, fallback: torch.Tensor | None = None,
                  vocab: int | None = None) -> list[torch.Tensor]:
    """Up to ``cfg.windows`` windows of ``cfg.tokens`` ids: calibration text, else ``fallback``
    text, else a fixed pseudo-random sequence (a fold must be exact on any input)."""
    wins = [w[: cfg.tokens].long() for w in calibration[: cfg.windows] if w.numel() >= 2]
    if not wins and fallback is not None and fallback.numel() >= 2:
        wins = [fallback[i: i + cfg.tokens].long() for i in range(0, cfg.windows * cfg.tokens, cfg.tokens)
                if fallback[i: i + cfg.tokens].numel() >= 2]
    if not wins:
        gen = torch.Generator().manual_seed(0)
        wins = [torch.randint(0, max(vocab or 2, 2), (min(cfg.tokens, 64),), generator=gen)]
    return wins


def _dtype_of(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def scaled_tolerance(tolerance: float, dtype: torch.dtype) -> float:
    """The tolerance for a model in ``dtype``: rounding grows with the dtype's epsilon."""
    if dtype == torch.float32 or dtype == torch.float64:
        return tolerance
    ratio = torch.finfo(dtype).eps / torch.finfo(torch.float32).eps
    return min(max(tolerance * ratio, tolerance), MAX_SCALED_TOLERANCE)


@torch.no_grad()
def _logits(model: nn.Module, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        return [model(input_ids=w.view(1, -1).to(device)).logits.float().cpu() for w in windows]
    finally:
        model.train(was_training)


@dataclass
class ExactnessProbe:
    """Reference logits taken before a fold, checked after it."""

    windows: list[torch.Tensor]
    reference: list[torch.Tensor]
    tolerance: float
    dtype: torch.dtype

    @classmethod
    def before(cls, model: nn.Module, windows: list[torch.Tensor], cfg: ExactnessConfig) -> "ExactnessProbe":
        dtype = _dtype_of(model)
        return cls(windows, _logits(model, windows), scaled_tolerance(cfg.tolerance, dtype), dtype)

    def after(self, model: nn.Module, what: str) -> dict:
        """Compare the folded model's logits with the reference; FoldNotExact (naming ``what``,
        the difference and the tolerance) if they differ more than rounding explains.
        Returns the figures for the stage's report details."""
        diff, scale = 0.0, 0.0
        for ref, out in zip(self.reference, _logits(model, self.windows)):
            if out.shape != ref.shape:
                raise FoldNotExact(f"{what}: the folded model's logits have shape {tuple(out.shape)}, "
                                   f"not {tuple(ref.shape)}")
            d = (out - ref).abs()
            diff = max(diff, float(d.max()) if torch.isfinite(d).all() else float("inf"))
            scale = max(scale, float(ref.abs().max()))
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        facts = {
            "max_abs_logit_diff": diff,
            "logit_scale": scale,
            "relative_diff": rel,
            "tolerance": self.tolerance,
            "windows": len(self.windows),
            "tokens": sum(int(w.numel()) for w in self.windows),
        }
        if self.dtype not in (torch.float32, torch.float64):
            facts["note"] = f"model in {str(self.dtype).removeprefix('torch.')}: tolerance scaled to its rounding"
        if not rel <= self.tolerance:
            raise FoldNotExact(
                f"{what} is not exact on this model: logits moved by up to {diff:.4g} (relative to the largest "
                f"logit {scale:.4g}: {rel:.3g}) on {facts['tokens']} calibration tokens, above the tolerance "
                f"{self.tolerance:.3g}; the fold does not match this architecture's layout, so the stage refuses "
                "rather than pass a changed model"
            )
        return facts
