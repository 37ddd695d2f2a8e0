"""Optimizers (AdamW, torchao AdamW8bit, CPU-offloaded states) and the warm-up schedule.

What runs where (checked against torchao 0.18's source and on this CPU):
- ``adamw8bit`` runs on CPU too; its per-parameter step is ``torch.compile``d, so the first
  step pays a one-time compile (about 25 s on a 2-core CPU).
- torchao's ``CPUOffloadOptimizer`` asserts a CUDA/XPU device. On a CPU-only run the
  states already live in host memory, so ``cpu_offload`` is a logged no-op there.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from train.config import OptimizerConfig, ScheduleConfig

log = logging.getLogger("optimize.train")


def _optimizer_class(cfg: OptimizerConfig):
    if cfg.name == "adamw":
        return torch.optim.AdamW, {}
    from torchao.optim import AdamW8bit

    return AdamW8bit, {}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig, device: torch.device):
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (all frozen?)")
    cls, extra = _optimizer_class(cfg)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, **extra)
    if cfg.cpu_offload:
        if device.type in ("cuda", "xpu"):
            from torchao.optim import CPUOffloadOptimizer

            return CPUOffloadOptimizer(params, cls, **kwargs)
        log.info("optimizer.cpu_offload: states already live in host memory on a CPU run; nothing to offload")
    return cls(params, **kwargs)


def lr_lambda(step: int, *, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at ``step`` (0-based): linear warm-up, then constant/cosine/linear."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Schedule:
    """A picklable lambda (LambdaLR stores the callable; closures would not survive spawn)."""

    def __init__(self, warmup: int, total: int, decay: str, min_ratio: float):
        self.kw = dict(warmup=warmup, total=total, decay=decay, min_ratio=min_ratio)

    def __call__(self, step: int) -> float:
        return lr_lambda(step, **self.kw)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, _Schedule(cfg.warmup_steps, total_steps, cfg.decay, cfg.min_lr_ratio))
