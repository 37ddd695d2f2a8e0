"""Optimizers (AdamW, torchao AdamW8bit, CPU-offloaded states) and the warm-up schedule.

What runs where (checked against torchao 0.18's source and on this CPU):
- ``adamw8bit`` runs on CPU too; its per-parameter step is ``torch.compile``d, so the first
  step pays a one-time compile (about 25 s on a 2-core CPU).
- torchao's ``CPUOffloadOptimizer`` asserts a CUDA/XPU device. On a CPU-only run the
  states already live in host memory, so ``cpu_offload`` is a logged no-op there. It is not a
  full ``torch.optim.Optimizer`` (no ``state``): ``train.checkpoint`` saves it its own way.
- plain AdamW on CUDA is the fused kernel (``fused=True``: one launch for all parameters
  instead of a chain of ``foreach`` kernels); on CPU it stays torch's default.
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


def use_fused_adamw(cfg: OptimizerConfig, device_types: set[str]) -> bool:
    """Fused AdamW when it is plain AdamW kept on the device and every parameter is on CUDA
    (FSDP2's DTensor shards included); CPU and host-offloaded states keep torch's default."""
    return cfg.name == "adamw" and not cfg.cpu_offload and device_types == {"cuda"}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig, device: torch.device):
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (all frozen?)")
    cls, extra = _optimizer_class(cfg)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, **extra)
    if use_fused_adamw(cfg, {p.device.type for p in params}):
        kwargs["fused"] = True
    if cfg.cpu_offload:
        if device.type in ("cuda", "xpu"):
            from torchao.optim import CPUOffloadOptimizer

            return CPUOffloadOptimizer(params, cls, **kwargs)
        log.info("optimizer.cpu_offload: states already live in host memory on a CPU run; nothing to offload")
    return cls(params, **kwargs)


def clip_offloaded_grads(optimizer, total_norm: torch.Tensor, max_norm: float | None) -> None:
    """Apply the gradient clip to the host copies of the gradients a ``CPUOffloadOptimizer`` steps on.

    Why: it copies each large parameter's gradient to the host in a post-accumulate hook, during
    backward, before the loop clips; its step then reads those unclipped copies, so without this
    ``grad_clip`` would silently skip every offloaded parameter. Same coefficient as
    ``clip_grad_norm_``; waits for the copies (its step waits for them anyway)."""
    host = getattr(optimizer, "param_d2h_map", None)
    if not host or not max_norm:
        return
    coef = float((max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0))
    if coef >= 1.0:
        return
    for p_device, copied in getattr(optimizer, "queue", {}).items():
        if hasattr(copied, "synchronize"):  # the CUDA event of the device-to-host copy
            copied.synchronize()
        host[p_device].grad.mul_(coef)


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
