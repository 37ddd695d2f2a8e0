"""The one training loop: ``train(model, data, cfg, loss_fn=None) -> TrainResult``.

Callers (the recipe runner, and the pipeline's ``distill`` and ``qat`` stages) pass a built
``nn.Module``, token ids and optionally their own loss, e.g. KL to a teacher:
``loss_fn(model, batch) -> scalar`` where ``batch`` has ``input_ids`` and shifted ``labels``.
Everything else (precision, memory savers, LoRA, FSDP2, checkpoints, resume, export, the
attention kernel and pattern, the chunked loss, the length curriculum) comes from the typed
:class:`~train.config.LoopConfig`. Without ``loss_fn`` the loss is next-token cross-entropy,
chunked through the output head (``train.chunked_loss``) unless ``loss.chunked`` is off. One
step (its loss, precision, micro-batches and optimizer step) is :mod:`train.step`'s; this module
owns the run around it: preparation, resume, read-backs, checkpoints and export.

The step never waits for the device: each micro-batch's loss is summed on the device, the
gradient norm stays a tensor, and both are read back (one sync, and under FSDP one all-reduce)
only when a logging interval closes (``logging.every_n_steps``), before a checkpoint, and after
the run's first step (so that step's compile and warm-up stay out of ``steady_tokens_per_s``).
fp16's GradScaler is the exception: its inf check reads the device every step.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from train import checkpoint as ckpt
from train.attention import configure_attention, restore_attention
from train.batching import MicroBatchPlan
from train.chunked_loss import check_head_matches_logits
from train.compile import compile_blocks, eager, uncompile
from train.config import LoopConfig
from train.curriculum import LengthSchedule, StagedBatches
from train.data import PackedWindows
from train.distributed import DistContext, all_reduce_max, apply_fsdp, init_distributed, teardown
from train.errors import TrainInputError
from train.export_hf import export_pretrained
from train.flops import device_peak, model_flops
from train.lora import apply_lora
from train.memory import apply_activation_checkpointing, peak_memory_mib, reset_peak_memory
from train.metrics import MetricsLogger
from train.optim import build_optimizer, build_scheduler
from train.step import LossFn, default_loss, optimizer_step, step_precision
from train.throughput import PendingSteps, Throughput

log = logging.getLogger("optimize.train")


@dataclass
class TrainResult:
    model: nn.Module
    losses: dict[int, float]
    start_step: int
    final_step: int
    resumed_from: Path | None
    tokens: int
    tokens_per_s: float
    peak_mem_mib: float
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    trainable_params: int
    total_params: int
    checkpoints: list[Path] = field(default_factory=list)
    exported_to: Path | None = None
    attention: dict = field(default_factory=dict)  # observed kernel and the pattern (AttentionSetup.report)
    loss: str = ""
    seq_lens: dict[int, int] = field(default_factory=dict)  # step -> window length (the curriculum)
    steady_tokens_per_s: float | None = None  # without the run's first step (compile, warm-up)
    mfu: float | None = None  # of the steady part (all steps if there is one); None without a known peak
    flops_per_token: float | None = None  # model FLOPs per trained token at the full window length
    device_name: str = ""
    peak_tflops: float | None = None  # per device, what MFU is measured against
    compiled_blocks: int = 0
    parallel: dict[str, int] = field(default_factory=dict)  # mesh sizes of a parallel layout


def prepare_model(model: nn.Module, cfg: LoopConfig, ctx: DistContext) -> nn.Module:
    """fp32 master weights, LoRA/QLoRA, activation checkpointing, per-block compile, then FSDP2 or
    device placement (torchtitan's order: checkpoint wrappers are compiled with their block, and
    FSDP2 shards the compiled blocks)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # a KV cache mutated inside a checkpointed block breaks recompute
    if cfg.precision.master_weights_fp32:
        model = model.float()
    if cfg.lora.enabled:  # with a parallel layout only under ep (train/parallel/config.py)
        model = apply_lora(model, cfg.lora, shard_world=ctx.dp_world if cfg.distributed.fsdp else 1)
    if ctx.parallel is not None:
        return _prepare_parallel(model, cfg, ctx)
    _checkpoint_and_compile(model, cfg)
    if cfg.distributed.fsdp:
        if not cfg.distributed.cpu_offload:
            model = model.to(ctx.device)
        model = apply_fsdp(model, cfg.distributed, ctx)
    else:
        model = model.to(ctx.device)
    model.train()
    return model


def _checkpoint_and_compile(model: nn.Module, cfg: LoopConfig) -> None:
    """Activation checkpointing, then per-block compile (the wrappers compile with their block)."""
    wrapped = apply_activation_checkpointing(model, cfg.memory)
    if wrapped:
        log.info("activation checkpointing (%s) on %d blocks", cfg.memory.activation_checkpointing, wrapped)
    compiled = compile_blocks(model, cfg.compile)
    if compiled:
        log.info("torch.compile (%s) on %d blocks; the first step compiles", cfg.compile.mode, compiled)


def _prepare_parallel(model: nn.Module, cfg: LoopConfig, ctx: DistContext) -> nn.Module:
    """torchtitan's order on one mesh: keep this rank's pipeline stage, split experts over ep and
    blocks over tp, checkpoint activations, compile each block, then FSDP2 over the data-parallel ranks."""
    from train.parallel.experts import apply_expert_parallel
    from train.parallel.pipeline import keep_stage
    from train.parallel.tensor import apply_tensor_parallel

    pmesh = ctx.parallel
    layout = pmesh.layout
    if layout.pp > 1:
        model = keep_stage(model, pmesh)
    model = model.to(ctx.device)
    experts = apply_expert_parallel(model, pmesh.dim("ep")) if layout.ep > 1 else []
    if layout.tp > 1:
        apply_tensor_parallel(model, pmesh.dim("tp"), cfg.parallel.sequence_parallel)
    _checkpoint_and_compile(model, cfg)
    if layout.dp_shard > 1:
        model = apply_fsdp(model, cfg.distributed, ctx, experts)
    if ctx.is_main:
        log.info("parallel layout: %s", layout.describe())
    model.train()
    return model


def _full_length(data, seq_len: int) -> int:
    """The longest window the run trains on (the context the attention pattern must fit in)."""
    if isinstance(data, PackedWindows):
        return data.seq_len
    data = torch.as_tensor(data)
    return data.shape[1] - 1 if data.dim() == 2 else seq_len


def _compute_dtype(model: nn.Module, cfg: LoopConfig) -> torch.dtype:
    if cfg.precision.mode != "fp32":
        return torch.bfloat16 if cfg.precision.mode == "bf16" else torch.float16
    if cfg.distributed.fsdp and cfg.distributed.param_dtype == "bfloat16":
        return torch.bfloat16
    return torch.float32 if cfg.precision.master_weights_fp32 else next(model.parameters()).dtype


def train(
    model: nn.Module,
    data: torch.Tensor | PackedWindows,
    cfg: LoopConfig,
    loss_fn: LossFn | None = None,
    *,
    seq_len: int = 256,
    tokenizer=None,
    ctx: DistContext | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train ``model`` on ``data`` (1-D token ids, or 2-D windows of ``seq_len + 1``).

    Resumes from the newest complete checkpoint in ``cfg.output_dir/checkpoints`` when
    ``cfg.checkpoint.resume`` is set. Under torchrun with ``distributed.fsdp`` every rank
    calls this; the process group is created and destroyed here unless ``ctx`` is given.
    ``on_step`` (rank 0 only) receives each step's metrics row as it is read back (``step``,
    ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``mfu``, ``peak_mem_mib``...; the fields
    of ``train/metrics.py``), in bursts of ``logging.every_n_steps``: progress bars, tracking.
    """
    own_ctx = ctx is None
    ctx = ctx or init_distributed(cfg.device, cfg.distributed, cfg.parallel)
    try:
        return _train(model, data, cfg, loss_fn, seq_len, tokenizer, ctx, on_step)
    finally:
        if own_ctx:
            teardown(ctx)


def _train(model, data, cfg: LoopConfig, loss_fn: LossFn | None, seq_len, tokenizer, ctx: DistContext,
           on_step: Callable[[dict], None] | None = None) -> TrainResult:
    out_dir = Path(cfg.output_dir)
    ckpt_root = out_dir / "checkpoints"
    torch.manual_seed(cfg.seed)
    full_len = _full_length(data, seq_len)
    schedule = LengthSchedule(cfg.curriculum, full_len)
    attn = configure_attention(model, cfg.attention, ctx.device, _compute_dtype(model, cfg), full_len)
    pp = ctx.parallel is not None and ctx.parallel.layout.pp > 1
    if pp and loss_fn is not None:
        raise TrainInputError(
            "train.parallel.pp: a caller's loss_fn(model, batch) needs the whole model in one forward; under a "
            "pipeline the last stage computes the next-token loss itself"
        )
    check_head = loss_fn is None and cfg.loss.chunked and not pp  # a stage is not a whole model
    loss_name = "caller's loss"
    if loss_fn is None:
        loss_fn, loss_name = default_loss(cfg)
    if ctx.is_main:
        log.info("loss: %s", loss_name)
        if len(schedule) > 1:
            log.info("length curriculum: %s", schedule.describe())
    if ctx.parallel is not None:
        from train.parallel.layout import check_model, check_modules

        check_model(ctx.parallel.layout, model.config, schedule.lengths(), cfg.parallel)
        check_modules(ctx.parallel.layout, model)
    model = prepare_model(model, cfg, ctx)
    pipeline = None
    if pp:
        from train.parallel.pipeline import build_schedule

        pipeline = build_schedule(
            model, ctx.parallel, ctx.device, cfg.parallel.pp_schedule, cfg.batch.grad_accum_steps,
            loss_chunk=cfg.loss.chunk_size if cfg.loss.chunked else None,  # the default loss: a caller's is refused
        )
    compiled_blocks = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    reset_peak_memory(ctx.device)  # measure training, not the one-off load/quantize transient
    fsdp = cfg.distributed.fsdp and (ctx.parallel is None or ctx.parallel.layout.dp_shard > 1)
    sharded = cfg.distributed.fsdp or ctx.parallel is not None  # parameters are DTensors
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optimizer, ctx.device)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.max_steps)
    scaler = torch.amp.GradScaler(ctx.device.type) if cfg.precision.mode == "fp16" else None
    plan = MicroBatchPlan(cfg.batch)

    loader_kwargs = dict(num_workers=cfg.data_workers, pin_memory=cfg.pin_memory, prefetch_factor=cfg.prefetch_factor)
    staged = StagedBatches(
        data, schedule, cfg.batch.effective_per_rank, rank=ctx.dp_rank, world=ctx.dp_world, seed=cfg.data_seed,
        loader_kwargs=loader_kwargs,
    )
    start_step, resumed_from = 0, None
    latest = ckpt.latest_checkpoint(ckpt_root) if cfg.checkpoint.resume else None
    if latest is not None:
        state = ckpt.load_checkpoint(latest, model, optimizer, skip_frozen=cfg.lora.enabled)
        start_step, resumed_from = int(state["step"]), latest
        staged.load_state_dict(state["data"], start_step)
        scheduler.load_state_dict(state["scheduler"])
        plan.load_state_dict(state["batch"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if ctx.is_main:
            log.info("resumed from %s at step %d", latest, start_step)

    metrics = MetricsLogger(cfg.logging, out_dir, cfg.max_steps, start_step, ctx.is_main)
    flops = model_flops(model, _attention_span(cfg))
    peak = device_peak(ctx.device, cfg.logging.peak_tflops)
    if ctx.is_main and peak.tflops is None:
        log.info("MFU: no bf16 peak known for %s (set train.logging.peak_tflops); reported as null", peak.device_name)
    losses: dict[int, float] = {}
    seq_lens: dict[int, int] = {}
    saved: list[Path] = []
    pending = PendingSteps(ctx)
    rate = Throughput(flops, peak, ctx.world)

    def trainer_state() -> dict:
        return {
            "data": staged.state_dict(),
            "scheduler": scheduler.state_dict(),
            "batch": plan.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
        }

    def read_back(steady: bool) -> None:
        """Close the interval: one sync, then the rows of its steps go to the log."""
        rows = pending.read()
        tok_s, interval_mfu = rate.close(steady)
        mem = peak_memory_mib(ctx.device)
        for row in rows:
            row.update(tokens_per_s=tok_s, mfu=interval_mfu, peak_mem_mib=mem)
            losses[row["step"]] = row["loss"]
            metrics.log(row)
            if on_step is not None and ctx.is_main:
                on_step(dict(row, total_steps=cfg.max_steps))

    compiled = cfg.compile.enabled
    rate.restart()  # the clock starts with the first step
    try:
        for step in range(start_step, cfg.max_steps):
            batch = staged.next_batch(step)
            batch = {k: v.to(ctx.device, non_blocking=True) for k, v in batch.items()}
            if step == start_step and check_head:
                # the step's autocast and SDPA kernel: a pinned kernel has no fp32 path on CUDA
                with attn.context(), step_precision(cfg, ctx.device), eager(compiled):
                    check_head_matches_logits(model, batch["input_ids"])
            record = staged.seq_len not in attn.by_length  # first step at this length: watch the kernels
            out = optimizer_step(
                model, batch, cfg, loss_fn, optimizer, scaler, plan, ctx, fsdp, attn, record, pipeline=pipeline
            )
            if record and ctx.is_main:
                log.info("%s", attn.describe(staged.seq_len))
            scheduler.step()
            done = step + 1
            rate.count(staged.seq_len, batch["input_ids"].numel() * ctx.dp_world)
            seq_lens[done] = staged.seq_len
            row = dict(
                step=done,
                lr=scheduler.get_last_lr()[0],
                micro_batch_size=plan.micro,
                grad_accum_steps=plan.accum,
                seq_len=staged.seq_len,
            )
            pending.add(row, out["loss"], out["grad_norm"])
            save_now = cfg.checkpoint.every_n_steps and done % cfg.checkpoint.every_n_steps == 0 and done < cfg.max_steps
            if done == start_step + 1 or done % cfg.logging.every_n_steps == 0 or done == cfg.max_steps or save_now:
                read_back(steady=done > start_step + 1)
            if save_now:
                saved.append(
                    ckpt.save_checkpoint(
                        ckpt_root, done, model, optimizer, trainer_state(), cfg.checkpoint.keep_last, cfg.lora.enabled
                    )
                )
                rate.restart()  # checkpoint writes are not training time
        if cfg.checkpoint.save_final and start_step < cfg.max_steps:
            saved.append(
                ckpt.save_checkpoint(
                    ckpt_root, cfg.max_steps, model, optimizer, trainer_state(), cfg.checkpoint.keep_last, cfg.lora.enabled
                )
            )
    finally:
        metrics.close()
        staged.close()  # stop loader workers promptly
        restore_attention(model, attn)  # the pattern was a training-time choice; export the model's own
        uncompile(model)  # so is compilation: whoever gets the model next runs it eagerly

    exported = None
    if cfg.checkpoint.export_hf:
        exported = export_pretrained(
            model, tokenizer, out_dir / "hf", cfg.lora, sharded=sharded, is_main=ctx.is_main,
            stages=ctx.parallel if pp else None,
        )
    peak_mem = all_reduce_max(peak_memory_mib(ctx.device), ctx)
    return TrainResult(
        model=model,
        losses=losses,
        start_step=start_step,
        final_step=cfg.max_steps,
        resumed_from=resumed_from,
        tokens=int(rate.tokens),
        tokens_per_s=rate.tokens_per_s,
        peak_mem_mib=peak_mem,
        micro_batch_size=plan.micro,
        grad_accum_steps=plan.accum,
        world_size=ctx.world,
        trainable_params=_whole_model(sum(p.numel() for p in params), ctx),
        total_params=_whole_model(sum(p.numel() for p in model.parameters()), ctx),
        checkpoints=saved,
        exported_to=exported,
        attention=attn.report(),
        loss=loss_name,
        seq_lens=seq_lens,
        steady_tokens_per_s=rate.steady_tokens_per_s,
        mfu=rate.run_mfu,
        flops_per_token=flops.per_token(full_len) if flops else None,
        device_name=peak.device_name,
        peak_tflops=peak.tflops,
        compiled_blocks=compiled_blocks,
        parallel=dataclasses.asdict(ctx.parallel.layout) if ctx.parallel is not None else {},
    )


def _whole_model(count: int, ctx: DistContext) -> int:
    """A parameter count of the whole model: DTensors already count whole; pipeline stages add up."""
    if ctx.parallel is None or ctx.parallel.layout.pp == 1:
        return count
    import torch.distributed as dist

    total = torch.tensor([count], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(total, group=ctx.parallel.dim("pp").get_group())
    return int(total.item())


def _attention_span(cfg: LoopConfig) -> int | None:
    """Keys a query sees under a sliding window (plus the global tokens); None for full causal attention."""
    window = cfg.attention.sliding_window
    return None if window is None else window + cfg.attention.global_tokens
