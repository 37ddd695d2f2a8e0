"""Short fine-tunes inside the pipeline: healing after a lossy rewrite (``gqa``, ``rmsnorm``),
distillation (``distill``) and quantization-aware training (``qat``).

One config shape (:class:`FinetuneConfig`, the trainer's names) and one adapter onto the
shared loop (:func:`train.loop.train`): :func:`train_in_place`, which every stage that trains
goes through, so the stage contract holds for all of them: the model is trained in place,
comes back in the mode and ``requires_grad`` state it arrived in, with no gradients, no
checkpoints left behind (a mid-stage resume checkpoint is deleted once training finishes) and
the HF ``use_cache`` flag restored.
Dropout is kept off (eval mode) while training: a few hundred steps of repair are not
pre-training, and it keeps the run deterministic for a given seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from optimize.losses import DistillLoss
from optimize.prune.records import sparse_masks
from targets.config_base import Strict
from train.config import (
    BatchConfig,
    CheckpointConfig,
    LoggingConfig,
    LoopConfig,
    MemoryConfig,
    OptimizerConfig,
    PrecisionConfig,
    ScheduleConfig,
)
from train.loop import train
from train.step import causal_lm_loss


class FinetuneConfig(Strict):
    """A short fine-tune inside the pipeline, in the trainer's own names (``optimizer.lr``,
    ``batch.micro_batch_size``, ``grad_clip``): the ``heal`` block of the rewrite stages and
    the training fields of ``distill`` and ``qat`` are all this one shape."""

    loss: Literal["distill", "lm"] = Field(
        "distill", description="distill: KL to a teacher (the model before the stage, unless the stage says "
        "otherwise), plus alpha x CE; lm: next-token cross-entropy on the training text alone"
    )
    steps: int = Field(50, ge=1, description="optimizer steps")
    seq_len: int = Field(256, ge=8, description="tokens per training window (non-overlapping windows of ctx.train_ids)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of the KL term (loss scaled by T^2)")
    alpha: float = Field(
        0.0, ge=0, lt=1, description="loss: distill only: weight of next-token cross-entropy; 1 - alpha weighs the KL"
    )
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this (null = off)")
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(lr=5e-5),
        description="train loop optimizer (AdamW); a small lr because the model is already trained",
    )
    schedule: ScheduleConfig = Field(
        default_factory=lambda: ScheduleConfig(warmup_steps=0, decay="constant"),
        description="train loop learning-rate schedule",
    )
    batch: BatchConfig = Field(
        default_factory=lambda: BatchConfig(micro_batch_size=2),
        description="windows per micro-batch and gradient accumulation steps",
    )
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="fp32 or bf16/fp16 autocast")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="activation checkpointing/offload")
    progress: bool = Field(False, description="show the train loop's tqdm bar")
    chunk_size: int | None = Field(
        1024, ge=1, description="loss: distill: tokens per chunk of the KL/CE over the vocabulary "
        "(train.chunked_loss: no full [tokens, vocab] logits, same value); null computes full logits"
    )
    checkpoint_every_n_steps: int = Field(
        0, ge=0, description="inside a pipeline stage: save a resumable training checkpoint (model, optimizer, "
        "data position) under the stage's work dir every n steps, so a killed run resumes mid-stage; 0 = off "
        "(the pipeline still checkpoints after the stage)"
    )
    keep_sparsity: bool = Field(
        True, description="weights an earlier prune stage (unstructured / semi_structured) zeroed stay zero: "
        "their gradients are masked; false lets training refill them"
    )
    frozen: list[str] = Field(
        default_factory=list, description="parameters kept as they are: 'embeddings' (the input embedding and the "
        "output projection, tied or not) and/or fnmatch patterns of parameter names (model.layers.0.*). A draft "
        "model (the pipeline's draft block) that keeps the loaded embeddings shares them with the target in the "
        "exported program")

    @model_validator(mode="after")
    def _alpha_needs_distill(self):
        if self.loss == "lm" and self.alpha:
            raise ValueError("alpha mixes CE into the distillation loss; with loss: lm it must stay 0")
        return self


class FinetuneError(ValueError):
    """A fine-tune cannot run as configured, or diverged."""


def check_tokens(train_ids: torch.Tensor, seq_len: int, windows: int, who: str) -> None:
    """The loop packs non-overlapping ``seq_len + 1`` windows and needs one step batch of them."""
    n = int(train_ids.numel())
    need = seq_len + 1
    if n < need:
        raise FinetuneError(f"{who} needs at least seq_len+1={need} training tokens; ctx.train_ids has {n}")
    have = (n - 1) // seq_len
    if have < windows:
        raise FinetuneError(
            f"{who}: ctx.train_ids ({n} tokens) holds {have} windows of seq_len={seq_len}, fewer than the "
            f"{windows} one optimizer step needs (batch x accumulation); lower seq_len or the batch"
        )


def _device_of(model: nn.Module) -> Literal["cpu", "cuda"]:
    p = next(model.parameters(), None)
    return "cuda" if p is not None and p.device.type == "cuda" else "cpu"


def _eval_mode(loss_fn):
    """The loop puts the model in train mode; switch dropout back off before every forward."""

    def wrapped(model, batch):
        model.eval()
        return loss_fn(model, batch)

    return wrapped


def _unwrap_checkpoints(model: nn.Module) -> int:
    """Undo the loop's activation-checkpoint wrappers: left in place, later stages, rewrites,
    resume and export would see a different module tree (and recompute on every forward)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CheckpointWrapper):
                parent.register_module(name, child._checkpoint_wrapped_module)
                count += 1
    return count


def train_in_place(
    model: nn.Module,
    train_ids: torch.Tensor,
    loss_fn,
    *,
    steps: int,
    seq_len: int,
    optimizer: OptimizerConfig,
    schedule: ScheduleConfig,
    batch: BatchConfig,
    grad_clip: float | None,
    precision: PrecisionConfig | None = None,
    memory: MemoryConfig | None = None,
    seed: int = 0,
    progress: bool = False,
    who: str = "train",
    resume_dir: Path | None = None,
    checkpoint_every: int = 0,
    masks: dict[str, torch.Tensor] | None = None,
    on_step: Callable[[dict], None] | None = None,
    frozen: set[str] = frozenset(),
) -> dict:
    """Train ``model`` in place with :func:`train.loop.train`; returns loss/tokens facts.

    ``loss_fn=None`` is next-token cross-entropy. No export is written (the pipeline owns
    artifacts). With ``resume_dir`` and ``checkpoint_every``, the loop checkpoints there every
    n steps and resumes from the newest checkpoint it finds; the directory is deleted once
    training finishes. Otherwise the loop's scratch directory is temporary. ``masks`` (by
    parameter name) keep those weights' zeros: their gradients are masked, then re-applied.
    ``on_step`` gets the loop's metrics row of every step (see :func:`train.loop.train`)."""
    check_tokens(train_ids, seq_len, batch.effective_per_rank, who)
    persistent = resume_dir is not None and checkpoint_every > 0
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    was_training = model.training
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    masks = {n: m for n, m in (masks or {}).items() if n in params}
    with contextlib.ExitStack() as stack:
        if persistent:
            Path(resume_dir).mkdir(parents=True, exist_ok=True)
            scratch = str(resume_dir)
        else:
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="optimize-train-"))
        loop = LoopConfig(
            output_dir=scratch,
            max_steps=steps,
            seed=seed,
            data_seed=seed,
            device=_device_of(model),
            grad_clip=grad_clip,
            batch=batch,
            optimizer=optimizer,
            schedule=schedule,
            precision=precision or PrecisionConfig(),
            memory=memory or MemoryConfig(),
            checkpoint=CheckpointConfig(every_n_steps=checkpoint_every if persistent else 0, keep_last=1,
                                        resume=persistent, save_final=False, export_hf=False),
            logging=LoggingConfig(progress_bar=progress, csv=False),
        )
        hooks = []
        try:
            with torch.inference_mode(False), torch.enable_grad():
                for n, p in model.named_parameters():
                    p.requires_grad_(n not in frozen)
                for name, mask in masks.items():
                    keep = mask.to(params[name].device, params[name].dtype)
                    hooks.append(params[name].register_hook(lambda g, keep=keep: g * keep))
                result = train(model, train_ids.long(), loop, _eval_mode(loss_fn or causal_lm_loss), seq_len=seq_len,
                               on_step=on_step)
        finally:
            for h in hooks:
                h.remove()
            with torch.no_grad():
                for name, mask in masks.items():
                    params[name].mul_(mask.to(params[name].device, params[name].dtype))
            _unwrap_checkpoints(model)
            for n, p in model.named_parameters():
                p.requires_grad_(grads.get(n, True))
                p.grad = None
            model.train(was_training)
            if use_cache is not None:
                config.use_cache = use_cache
    if result.model is not model:
        raise FinetuneError(f"{who}: the training loop returned a different module (LoRA/FSDP are not used in stages)")
    if persistent:
        shutil.rmtree(resume_dir, ignore_errors=True)  # finished: the pipeline checkpoints the stage
    losses = [result.losses[k] for k in sorted(result.losses)]
    bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
    if bad:
        raise FinetuneError(f"{who} loss became {losses[bad[0]]} at step {bad[0]}; lower the learning rate")
    k = min(5, len(losses))
    stride = max(1, len(losses) // 50)
    extra = {"resumed_at_step": result.start_step} if result.start_step else {}
    if masks:
        extra["sparse_weights_kept_zero"] = int(sum(int((~m).sum()) for m in masks.values()))
    return {
        **extra,
        "steps": steps,
        "lr": optimizer.lr,
        "seq_len": seq_len,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_first5_mean": sum(losses[:k]) / k,
        "loss_last5_mean": sum(losses[-k:]) / k,
        "loss_curve": losses[::stride],
        "tokens_seen": int(result.tokens),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def fingerprint(*modules: nn.Module | None) -> str:
    """A cheap digest of parameter names, shapes and a strided sample of values: tells a
    resumed stage whether a mid-stage checkpoint belongs to the model it starts from."""
    h = hashlib.sha256()
    for m in modules:
        if m is None:
            continue
        for name, p in m.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
            h.update(f"{name}{tuple(p.shape)}{str(p.dtype)}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def _step_events(progress: Callable[..., None], steps: int, who: str) -> Callable[[dict], None]:
    """The loop's per-step metrics row as a ``train`` progress event (bar, callback, tracking)."""

    def on_step(row: dict) -> None:
        progress(row["step"], steps, phase="train", loss=row.get("loss"), tokens_per_s=row.get("tokens_per_s"),
                 lr=row.get("lr"), grad_norm=row.get("grad_norm"), peak_mem_mib=row.get("peak_mem_mib"), who=who)

    return on_step


def frozen_names(model: nn.Module, patterns: list[str], who: str) -> set[str]:
    """The parameter names ``patterns`` select (``embeddings``: the input embedding's and the output
    projection's); a pattern that selects nothing is refused, naming what there is."""
    import fnmatch

    names = {id(p): n for n, p in model.named_parameters()}
    out: set[str] = set()
    for pat in patterns:
        if pat == "embeddings":
            mods = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
            hit = {names[id(p)] for m in mods for p in m.parameters() if id(p) in names}
        else:
            hit = {n for n in names.values() if fnmatch.fnmatchcase(n, pat)}
        if not hit:
            sample = ", ".join(sorted(names.values())[:4])
            raise FinetuneError(f"{who}: frozen pattern {pat!r} matches no parameter (use 'embeddings' or a pattern "
                                f"of names such as {sample}, ...)")
        out |= hit
    if out and len(out) == len(names):
        raise FinetuneError(f"{who}: frozen keeps every parameter; nothing would train")
    return out


def finetune(
    model: nn.Module,
    cfg: FinetuneConfig,
    train_ids: torch.Tensor,
    *,
    teacher: nn.Module | None = None,
    loss_fn=None,
    seed: int = 0,
    who: str = "finetune",
    log: Callable[[str], None] = print,
    work_dir: Path | None = None,
    progress: Callable[..., None] | None = None,
) -> dict:
    """Fine-tune ``model`` in place as ``cfg`` says; returns JSON-serializable facts.

    ``loss: distill`` needs ``teacher``; ``loss_fn`` (``(model, batch) -> loss``) replaces the
    loss ``cfg`` would build, for stages with losses of their own. With ``work_dir`` and
    ``cfg.checkpoint_every_n_steps``, training checkpoints under ``work_dir`` (in a directory
    keyed by the config, seed, model and teacher) and a re-run resumes from it. ``progress`` is a
    stage's ``ctx.progress``: it gets a ``train`` phase (begin, one event per step with the loss,
    tokens/s, lr and peak memory, end), which draws the bar and feeds ``run_pipeline``'s callback."""
    built = None
    if loss_fn is None and cfg.loss == "distill":
        if teacher is None:
            raise FinetuneError(f"{who}: loss 'distill' needs a teacher model")
        teacher.eval()
        loss_fn = built = DistillLoss(teacher, temperature=cfg.temperature, alpha=cfg.alpha, chunk_size=cfg.chunk_size)
    masks = sparse_masks(model) if cfg.keep_sparsity else {}
    frozen = frozen_names(model, cfg.frozen, who)
    resume_dir = None
    if work_dir is not None and cfg.checkpoint_every_n_steps:
        key = hashlib.sha256(json.dumps([cfg.model_dump(mode="json"), seed, who, fingerprint(model, teacher)],
                                        sort_keys=True).encode()).hexdigest()[:12]
        resume_dir = Path(work_dir) / f"{who}-train-{key}"
    on_step = _step_events(progress, cfg.steps, who) if progress is not None else None
    if progress is not None:
        progress(0, cfg.steps, phase="train", event="begin", message=f"{who}: {cfg.steps} steps ({cfg.loss})")
    try:
        facts = train_in_place(
            model,
            train_ids,
            loss_fn,
            steps=cfg.steps,
            seq_len=cfg.seq_len,
            optimizer=cfg.optimizer,
            schedule=cfg.schedule,
            batch=cfg.batch,
            grad_clip=cfg.grad_clip,
            precision=cfg.precision,
            memory=cfg.memory,
            seed=seed,
            progress=cfg.progress,
            who=who,
            resume_dir=resume_dir,
            checkpoint_every=cfg.checkpoint_every_n_steps,
            masks=masks,
            on_step=on_step,
            frozen=frozen,
        )
    finally:
        if built is not None:
            built.close()
    if progress is not None:
        progress(cfg.steps, cfg.steps, phase="train", event="end", message=f"{who}: done")
    out = {"loss": cfg.loss, "micro_batch_size": cfg.batch.micro_batch_size,
           "grad_accum_steps": cfg.batch.grad_accum_steps, **facts}
    if "resumed_at_step" in out:
        log(f"{who}: resumed from its checkpoint at step {out['resumed_at_step']}")
    log(f"{who} ({cfg.loss}): loss {out['loss_first']:.4f} -> {out['loss_last']:.4f} in {cfg.steps} steps "
        f"({out['tokens_seen']} tokens)")
    return out
