"""Recipe runner: load model and text from a recipe, train, and return a JSON-serializable report.

This is what ``python -m train recipe.yaml`` (and the CLI's ``optimize train``) calls. The
report is also written atomically to ``<output_dir>/report.json`` by rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from pydantic import BaseModel, Field

from targets.atomic import atomic_write_json
from train.attention import check_backend_available
from train.config import TrainRecipe
from targets.sources.corpus import load_text, tokenize
from train.distributed import init_distributed, teardown
from train.loop import train
from targets.sources import load_model
from train.tracking import MlflowRun, config_params, numeric_leaves, train_step_metrics

log = logging.getLogger("optimize.train")


class TrainReport(BaseModel):
    """What a training run did; every field is plain JSON."""

    model: str = Field(description="model source description")
    output_dir: str = Field(description="run directory (checkpoints, metrics.csv, hf/, report.json)")
    start_step: int = Field(description="step the run started from (0, or the resumed checkpoint's step)")
    final_step: int = Field(description="last optimizer step")
    resumed_from: str | None = Field(description="checkpoint the run resumed from, if any")
    losses: dict[int, float] = Field(description="global mean loss per optimizer step trained in this run")
    first_loss: float | None = Field(description="loss at the first step of this run")
    final_loss: float | None = Field(description="loss at the last step of this run")
    train_tokens: int = Field(description="tokens in the training split")
    tokens_seen: int = Field(description="tokens processed in this run, all ranks")
    tokens_per_s: float = Field(description="training throughput over this run, all ranks")
    steady_tokens_per_s: float | None = Field(
        None, description="throughput without the run's first step (compile and warm-up), all ranks; null for one step"
    )
    mfu: float | None = Field(
        None,
        description="model FLOPs utilization (0..1) of the steady part against the devices' dense bf16 peak; null "
        "where the peak is unknown (CPU, an unlisted GPU without train.logging.peak_tflops)",
    )
    flops_per_token: float | None = Field(
        None, description="model FLOPs per trained token at data.seq_len (forward + backward; see train/flops.py)"
    )
    device_name: str = Field("", description="the device trained on (CUDA device name, or cpu)")
    peak_tflops: float | None = Field(None, description="dense bf16 peak TFLOP/s per device that MFU is measured against")
    compiled_blocks: int = Field(0, description="transformer blocks run through torch.compile (train.compile)")
    peak_mem_mib: float = Field(description="peak memory per rank (CPU: peak RSS; CUDA: max allocated)")
    world_size: int = Field(description="number of ranks")
    parallel: dict[str, int] = Field(
        default_factory=dict, description="mesh sizes of a parallel layout (dp_shard, tp, pp, ep); empty for plain runs"
    )
    micro_batch_size: int = Field(description="micro-batch at the end (smaller than configured after an OOM)")
    grad_accum_steps: int = Field(description="accumulation steps at the end")
    trainable_params: int = Field(description="parameters the optimizer updates (whole model, not per shard)")
    total_params: int = Field(description="all parameters (whole model, not per shard; NF4 counted unpacked)")
    checkpoints: list[str] = Field(description="checkpoints written by this run")
    exported_to: str | None = Field(description="consolidated Hugging Face model directory")
    attention_kernel: str = Field("", description="attention kernel observed in the first forward, e.g. sdpa:flash")
    attention: dict = Field(default_factory=dict, description="attention implementation, kernel calls and pattern")
    loss: str = Field("", description="the loss that trained (chunked or full-logits cross-entropy)")
    seq_lens: dict[int, int] = Field(default_factory=dict, description="window length per step (the curriculum)")


def _train_ids(recipe: TrainRecipe, tokenizer):
    ids = tokenize(load_text(recipe.data.corpus), tokenizer)
    ids = ids[recipe.data.skip_eval_tokens :]
    if recipe.data.max_tokens is not None:
        ids = ids[: recipe.data.max_tokens]
    if ids.numel() < recipe.data.seq_len + 1:
        raise ValueError(
            f"data: {ids.numel()} training tokens after skipping {recipe.data.skip_eval_tokens}; "
            f"need at least seq_len + 1 = {recipe.data.seq_len + 1}"
        )
    return ids


def _start_tracking(recipe: TrainRecipe, cfg, is_main: bool):
    """The recipe's MLflow run (rank 0 only; None without ``tracking.mlflow``): the recipe as params."""
    if not is_main or recipe.tracking is None or recipe.tracking.mlflow is None:
        return None
    out = Path(cfg.output_dir)
    run = MlflowRun(recipe.tracking.mlflow, out.name or "train", say=log.warning,
                    tags={"optimize.kind": "train", "optimize.output_dir": str(out)})
    run.log_params(config_params(recipe.model_dump(mode="json")))
    return run


def _step_metrics(run):
    def on_step(row: dict) -> None:
        run.log_metrics(train_step_metrics(row), row["step"])

    return on_step


def _finish_tracking(run, report: "TrainReport", out_dir: Path) -> None:
    summary = {k: v for k, v in numeric_leaves(report.model_dump(mode="json")).items()
               if "." not in k and k not in ("start_step", "final_step")}  # scalars only; losses per step are logged
    run.log_metrics({f"run.{k}": v for k, v in summary.items()}, step=report.final_step)
    for name in ("report.json", "metrics.csv"):
        run.log_artifact(out_dir / name)


def run_training(recipe: TrainRecipe) -> TrainReport:
    """Build everything the recipe names and train it (every rank calls this under torchrun).

    With ``tracking.mlflow`` rank 0 records an MLflow run: the recipe as params, every step's
    loss, lr, grad norm, tokens/s, MFU and peak memory as metrics, ``report.json`` and
    ``metrics.csv`` as artifacts; FINISHED, or FAILED when training raised."""
    cfg = recipe.loop_config()
    ctx = init_distributed(cfg.device, cfg.distributed, cfg.parallel)
    tracker, status = None, "FAILED"
    try:
        # before loading: the model source would quietly fall back to sdpa where flash-attn cannot run
        check_backend_available(cfg.attention.backend or recipe.model.attn_implementation, ctx.device)
        tracker = _start_tracking(recipe, cfg, ctx.is_main)
        on_step = _step_metrics(tracker) if tracker is not None else None

        loaded = load_model(recipe.model)
        ids = _train_ids(recipe, loaded.tokenizer)
        result = train(loaded.model, ids, cfg, seq_len=recipe.data.seq_len, tokenizer=loaded.tokenizer, ctx=ctx,
                       on_step=on_step)
        losses = result.losses
        report = TrainReport(
            model=loaded.description,
            output_dir=str(cfg.output_dir),
            start_step=result.start_step,
            final_step=result.final_step,
            resumed_from=str(result.resumed_from) if result.resumed_from else None,
            losses=losses,
            first_loss=losses[min(losses)] if losses else None,
            final_loss=losses[max(losses)] if losses else None,
            train_tokens=int(ids.numel()),
            tokens_seen=result.tokens,
            tokens_per_s=result.tokens_per_s,
            steady_tokens_per_s=result.steady_tokens_per_s,
            mfu=result.mfu,
            flops_per_token=result.flops_per_token,
            device_name=result.device_name,
            peak_tflops=result.peak_tflops,
            compiled_blocks=result.compiled_blocks,
            peak_mem_mib=result.peak_mem_mib,
            world_size=result.world_size,
            parallel=result.parallel,
            micro_batch_size=result.micro_batch_size,
            grad_accum_steps=result.grad_accum_steps,
            trainable_params=result.trainable_params,
            total_params=result.total_params,
            checkpoints=[str(p) for p in result.checkpoints],
            exported_to=str(result.exported_to) if result.exported_to else None,
            attention_kernel=result.attention.get("kernel", ""),
            attention=result.attention,
            loss=result.loss,
            seq_lens=result.seq_lens,
        )
        if ctx.is_main:
            atomic_write_json(Path(cfg.output_dir) / "report.json", report.model_dump(mode="json"))
        if tracker is not None:
            _finish_tracking(tracker, report, Path(cfg.output_dir))
        status = "FINISHED"
        return report
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if tracker is not None:
            tracker.end(status)
        teardown(ctx)


class LayoutReport(BaseModel):
    """What ``python -m train --check`` found: the recipe, the model and the layout agree."""

    model: str = Field(description="model source kind (hf, gguf, bundled, random)")
    model_type: str = Field(description="the model's family (transformers model_type)")
    world_size: int = Field(description="ranks the layout was checked for")
    parallel: dict[str, int] = Field(description="resolved mesh sizes (dp_shard, tp, pp, ep)")
    window_lengths: list[int] = Field(description="every window length the run trains on")


def check_recipe(recipe: TrainRecipe, world_size: int) -> LayoutReport:
    """Refuse, before any rank starts or any weight loads, a layout the model cannot take: sizes
    that do not multiply to ``world_size``, heads, KV heads, MLP columns or window lengths that
    ``tp`` does not divide, fewer blocks than ``pp`` stages, experts that ``ep`` does not divide,
    a family a split does not know (a :class:`~train.errors.TrainInputError` naming the reason)."""
    from targets.sources.models import peek_config
    from train.curriculum import LengthSchedule
    from train.model_parts import meta_model
    from train.parallel.layout import check_model, check_modules, resolve

    cfg = recipe.loop_config()
    layout = resolve(cfg.parallel, world_size, cfg.distributed.fsdp)
    config = peek_config(recipe.model)
    lengths = LengthSchedule(cfg.curriculum, recipe.data.seq_len).lengths()
    check_model(layout, config, lengths, cfg.parallel)
    check_modules(layout, meta_model(config))
    return LayoutReport(
        model=recipe.model.source,
        model_type=getattr(config, "model_type", type(config).__name__),
        world_size=world_size,
        parallel=dataclasses.asdict(layout),
        window_lengths=lengths,
    )


def configure_threads() -> None:
    """Honour OMP_NUM_THREADS explicitly (torch otherwise uses every core, which thrashes when shared)."""
    n = os.environ.get("OMP_NUM_THREADS")
    if n and n.isdigit():
        import torch

        torch.set_num_threads(int(n))
