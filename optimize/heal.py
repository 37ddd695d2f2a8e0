"""A short healing run after a lossy rewrite: distil from the pre-rewrite model (KL to the
teacher's next-token distribution) or plain next-token fine-tuning on ``ctx.train_ids``.

Deliberately small and self-contained so it can be swapped for the shared training loop in
``train/`` later; the stages only call :func:`heal` with a :class:`HealConfig`.
Training runs with the model in eval mode (dropout off): a few hundred steps of repair are
not pre-training, and it keeps the run deterministic for a given seed.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from targets.config_base import Strict


class HealConfig(Strict):
    """How to heal a rewritten model."""

    mode: Literal["distill", "lm"] = Field(
        "distill", description="distill: KL to the pre-rewrite model as teacher; lm: next-token loss on train text"
    )
    steps: int = Field(50, gt=0, description="optimizer steps")
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate (constant after a short warm-up)")
    seq_len: int = Field(256, ge=8, description="tokens per training window")
    batch_size: int = Field(2, gt=0, description="windows per step")
    warmup_steps: int = Field(5, ge=0, description="linear learning-rate warm-up steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    temperature: float = Field(1.0, gt=0, description="softmax temperature for distillation")
    progress: bool = Field(True, description="show a tqdm progress bar")


class HealError(ValueError):
    """Healing cannot run as configured."""


def _batches(train_ids: torch.Tensor, cfg: HealConfig, gen: torch.Generator):
    n = int(train_ids.numel())
    need = cfg.seq_len + 1
    if n < need:
        raise HealError(f"heal needs at least seq_len+1={need} training tokens; ctx.train_ids has {n}")
    for _ in range(cfg.steps):
        starts = torch.randint(0, n - need + 1, (cfg.batch_size,), generator=gen)
        yield torch.stack([train_ids[s : s + need] for s in starts.tolist()])


def _loss(model, teacher, batch: torch.Tensor, cfg: HealConfig) -> torch.Tensor:
    inputs = batch[:, :-1]
    logits = model(input_ids=inputs).logits.float()
    if cfg.mode == "lm":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    with torch.no_grad():
        t_logits = teacher(input_ids=inputs).logits.float()
    t = cfg.temperature
    s_log = F.log_softmax(logits / t, dim=-1).reshape(-1, logits.shape[-1])
    t_log = F.log_softmax(t_logits / t, dim=-1).reshape(-1, logits.shape[-1])
    return F.kl_div(s_log, t_log, log_target=True, reduction="batchmean") * (t * t)


def heal(
    model: torch.nn.Module,
    cfg: HealConfig,
    train_ids: torch.Tensor,
    *,
    teacher: torch.nn.Module | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Train ``model`` in place; returns JSON-serializable facts (loss curve ends, settings)."""
    from tqdm.auto import tqdm

    if cfg.mode == "distill" and teacher is None:
        raise HealError("heal mode 'distill' needs a teacher model")
    if teacher is not None:
        teacher.eval()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    was_training = model.training
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    params = [p for p in model.parameters()]
    losses: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode(False), torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        model.eval()
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warm = max(cfg.warmup_steps, 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warm + 1)))
        bar = tqdm(_batches(train_ids.long(), cfg, gen), total=cfg.steps, desc=f"heal ({cfg.mode})",
                   disable=not cfg.progress)
        try:
            for batch in bar:
                loss = _loss(model, teacher, batch, cfg)
                if not math.isfinite(loss.item()):
                    raise HealError(f"heal loss became {loss.item()} at step {len(losses)}; lower heal.lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                opt.step()
                sched.step()
                losses.append(float(loss.item()))
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
        finally:
            bar.close()
            opt.zero_grad(set_to_none=True)
            for n, p in model.named_parameters():
                p.requires_grad_(grads.get(n, True))
            model.train(was_training)
    k = min(5, len(losses))
    stride = max(1, len(losses) // 50)
    out = {
        "mode": cfg.mode,
        "steps": cfg.steps,
        "lr": cfg.lr,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_first5_mean": sum(losses[:k]) / k,
        "loss_last5_mean": sum(losses[-k:]) / k,
        "loss_curve": losses[::stride],
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    log(f"heal ({cfg.mode}): loss {out['loss_first']:.4f} -> {out['loss_last']:.4f} in {cfg.steps} steps")
    return out
