"""The ``train.parallel`` block of a recipe, and what it cannot run with.

Kept apart from ``train/config.py`` (which imports it) so the parallel layer owns its config as
torchtitan's components do; :func:`parallel_conflicts` is the part of ``LoopConfig``'s validation
that concerns it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from targets.config_base import Strict


class ParallelConfig(Strict):
    """The device mesh of a torchrun job: data-parallel sharding, tensor, pipeline and expert
    parallelism on one ``DeviceMesh`` (``train/parallel``). The sizes multiply to the world size;
    ``ep`` borrows its ranks from ``dp_shard`` (as torchtitan's does): an expert's tokens come from
    the data-parallel ranks of its group, and the dense weights stay sharded over all of them."""

    dp_shard: int | Literal["auto"] = Field(
        "auto", description="FSDP2 data-parallel sharding degree; auto = world size / (tp * pp)"
    )
    tp: int = Field(1, ge=1, description="tensor parallelism: attention heads and MLP columns split over tp ranks")
    pp: int = Field(1, ge=1, description="pipeline parallelism: the decoder blocks split into pp stages")
    ep: int = Field(1, ge=1, description="expert parallelism (mixture-of-experts models): experts split over ep "
                    "ranks, which are taken from dp_shard (ep must divide it)")
    pp_schedule: Literal["gpipe", "1f1b"] = Field(
        "1f1b", description="pipeline schedule (torch.distributed.pipelining); micro-batches = batch.grad_accum_steps"
    )
    sequence_parallel: bool = Field(
        True, description="with tp: the norms and residual stream sharded over the sequence (Megatron-SP)"
    )

    @field_validator("dp_shard")
    @classmethod
    def _positive(cls, value):
        if value != "auto" and value < 1:
            raise ValueError(f"dp_shard must be 'auto' or a positive integer, got {value}")
        return value

    @property
    def multi_dim(self) -> bool:
        """Whether anything beyond plain data-parallel FSDP2 is asked for."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1


def parallel_conflicts(cfg) -> None:
    """Raise ValueError for what ``cfg.parallel`` (of a ``LoopConfig``) cannot run with, known from the
    config alone; the model and the world size are checked by :mod:`train.parallel.layout`."""
    par = cfg.parallel
    if isinstance(par.dp_shard, int) and par.dp_shard > 1 and not cfg.distributed.fsdp:
        raise ValueError(
            f"parallel.dp_shard {par.dp_shard} shards the data-parallel ranks with FSDP2: set distributed.fsdp: true"
        )
    if isinstance(par.dp_shard, int) and par.dp_shard % par.ep:
        raise ValueError(
            f"parallel.ep {par.ep} takes its ranks from parallel.dp_shard {par.dp_shard}, so it must divide it"
        )
    if not par.multi_dim:
        return
    dims = ", ".join(f"{k} {getattr(par, k)}" for k in ("tp", "pp", "ep") if getattr(par, k) > 1)
    if par.ep > 1 and par.tp > 1:
        raise ValueError(
            f"parallel: ep with tp is not supported (the experts would need a tensor-parallel split of their own); "
            f"use ep with dp_shard and pp (got {dims})"
        )
    refusals = [
        (cfg.lora.enabled and (par.tp > 1 or par.pp > 1), "lora.enabled",
         "peft's adapters wrap the nn.Linear projections that the tensor split takes apart, and wrap the model "
         "whose forward the pipeline stages replace; train LoRA with dp_shard and ep"),
        (par.ep > 1 and cfg.compile.enabled, "compile.enabled", "dynamo fails on the experts' routed dispatch "
         "(torch 2.13: IndexError while creating a guard); train ep with compile off"),
        (cfg.precision.mode == "fp16", "precision.mode fp16", "GradScaler's inf check does not reduce over the "
         "mesh; use bf16 (no loss scaling needed)"),
        (cfg.batch.dynamic, "batch.dynamic", "an out-of-memory on one rank would desynchronise the collectives"),
        (cfg.optimizer.cpu_offload or cfg.distributed.cpu_offload, "cpu_offload",
         "offloading is tested with plain FSDP2 only; use dp_shard alone to offload"),
        (par.pp > 1 and cfg.attention.sliding_window is not None, "attention.sliding_window",
         "the training-time window (train.attention) is applied through the model's own forward, which the "
         "pipeline stages replace; train the window without pp"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise ValueError(f"train.{key} cannot run with parallel {dims}: {why}")
    if par.pp > 1 and par.pp_schedule == "1f1b" and cfg.batch.grad_accum_steps < par.pp:
        raise ValueError(
            f"parallel.pp_schedule 1f1b needs at least as many micro-batches as stages: batch.grad_accum_steps "
            f"{cfg.batch.grad_accum_steps} < pp {par.pp} (raise grad_accum_steps or use pp_schedule gpipe)"
        )
