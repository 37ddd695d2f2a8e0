"""Typed configs for every trainer component; a recipe is these blocks plus a model source.

Each block is a :class:`Strict` model, so a typo in YAML names the allowed keys. The
blocks are small on purpose: the pipeline's ``distill`` and ``qat`` stages build a
:class:`LoopConfig` in Python and never touch YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from targets.config_base import Strict
from train.sources import ModelSource


class DataConfig(Strict):
    corpus: str = Field("pydoc", description="'pydoc' (CPython's bundled docs), a text file or a directory of text files")
    seq_len: int = Field(256, ge=8, description="tokens per packed training window")
    skip_eval_tokens: int = Field(
        4096, ge=0, description="leading corpus tokens held out (the project's evaluation span), never trained on"
    )
    max_tokens: int | None = Field(None, ge=16, description="use at most this many training tokens (tiny runs)")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes (0 = load in the training process)")
    pin_memory: bool = Field(False, description="pin host batches for faster host-to-GPU copies (ignored on CPU)")
    prefetch_factor: int | None = Field(None, ge=1, description="batches prefetched per worker (needs num_workers > 0)")
    seed: int = Field(0, description="seed of the per-epoch shuffle; the resume position is exact for a fixed seed")


class OptimizerConfig(Strict):
    name: Literal["adamw", "adamw8bit"] = Field(
        "adamw", description="adamw (torch) or adamw8bit (torchao block-quantized states; compiles on first step)"
    )
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    cpu_offload: bool = Field(
        False,
        description="keep optimizer states and the step on the CPU (torchao CPUOffloadOptimizer; CUDA/XPU only, "
        "a no-op on a CPU-only run where states already live in host memory; under FSDP use distributed.cpu_offload)",
    )


class ScheduleConfig(Strict):
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps from 0 to the peak learning rate")
    decay: Literal["constant", "cosine", "linear"] = Field("cosine", description="shape after warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of the peak")


class PrecisionConfig(Strict):
    mode: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32, bf16 autocast, or fp16 autocast with GradScaler loss scaling"
    )
    master_weights_fp32: bool = Field(
        True, description="keep trainable parameters (and optimizer states) in fp32 whatever the load dtype"
    )


class MemoryConfig(Strict):
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="full: recompute whole blocks in backward; selective: keep matmul/attention outputs, recompute the rest",
    )
    checkpoint_every_n_layers: int = Field(1, ge=1, description="checkpoint every n-th transformer block only")
    activation_offload: bool = Field(
        False, description="move saved activations to host memory during forward (torch save_on_cpu)"
    )


class LoRAConfig(Strict):
    enabled: bool = Field(False, description="train low-rank adapters (peft) instead of the full model")
    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="adapter scale numerator (scale = alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="names of the Linear layers that get adapters",
    )
    quantize_base: Literal["none", "nf4"] = Field(
        "none", description="nf4: store frozen base weights as torchao NF4 (QLoRA); adapters stay in full precision"
    )
    nf4_block_size: int = Field(64, ge=8, description="NF4 quantization block size")


class DistributedConfig(Strict):
    fsdp: bool = Field(False, description="shard with FSDP2 (fully_shard per block, then the root); needs torchrun")
    reshard_after_forward: bool = Field(True, description="free gathered parameters after forward (ZeRO-3 style)")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="FSDP MixedPrecisionPolicy dtype for gathered parameters and compute"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the gradient reduce-scatter")
    cpu_offload: bool = Field(False, description="FSDP CPUOffloadPolicy: sharded params, grads and optimizer step on host")
    timeout_s: int = Field(600, ge=10, description="collective timeout; a dead rank fails the job instead of hanging it")


class CheckpointConfig(Strict):
    every_n_steps: int = Field(0, ge=0, description="save every n optimizer steps (0 = only at the end)")
    keep_last: int = Field(2, ge=1, description="complete checkpoints kept; older ones are deleted")
    resume: bool = Field(True, description="continue from the newest complete checkpoint in output_dir if any")
    save_final: bool = Field(True, description="also checkpoint after the last step")
    export_hf: bool = Field(True, description="write a consolidated Hugging Face save_pretrained model at the end")


class LoggingConfig(Strict):
    every_n_steps: int = Field(1, ge=1, description="log loss, tokens/s and peak memory every n steps")
    progress_bar: bool = Field(True, description="show a tqdm bar on rank 0")
    csv: bool = Field(True, description="append metrics to output_dir/metrics.csv")
    tensorboard: bool = Field(False, description="also write TensorBoard events (skipped with a warning if not installed)")


class BatchConfig(Strict):
    micro_batch_size: int = Field(4, ge=1, description="windows per forward/backward pass, per rank")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches accumulated per optimizer step")
    dynamic: bool = Field(
        False, description="on out-of-memory halve the micro-batch and double accumulation (effective batch unchanged)"
    )
    min_micro_batch_size: int = Field(1, ge=1, description="give up below this micro-batch size")

    @property
    def effective_per_rank(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps


class LoopConfig(Strict):
    """Everything the loop itself needs; a Python caller builds only this."""

    output_dir: Path = Field(Path("runs/train"), description="checkpoints, metrics, report and the exported model")
    max_steps: int = Field(100, ge=1, description="optimizer steps to train in total (resumed runs included)")
    seed: int = Field(0, description="seed for parameter-free randomness (dropout) on every rank")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda when available")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this (null = off)")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="micro-batch and accumulation")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="optimizer")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="learning-rate schedule")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="mixed precision")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="activation memory savers")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA / QLoRA adapters")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="FSDP2 sharding")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints and export")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="metrics output")
    data_workers: int = Field(0, ge=0, description="DataLoader workers (copied from data.num_workers by recipes)")
    pin_memory: bool = Field(False, description="pin host batches (copied from data.pin_memory by recipes)")
    prefetch_factor: int | None = Field(None, ge=1, description="per-worker prefetch (copied from data by recipes)")
    data_seed: int = Field(0, description="shuffle seed (copied from data.seed by recipes)")

    @model_validator(mode="after")
    def _consistent(self) -> "LoopConfig":
        if self.precision.mode == "fp16" and self.distributed.fsdp:
            raise ValueError("precision.mode fp16 is not supported with distributed.fsdp; use bf16 (no loss scaling needed)")
        if self.batch.dynamic and self.distributed.fsdp:
            raise ValueError(
                "batch.dynamic is single-process only: an OOM on one FSDP rank would desynchronise the collectives"
            )
        if self.lora.quantize_base != "none" and not self.lora.enabled:
            raise ValueError("lora.quantize_base needs lora.enabled: true (QLoRA trains adapters on a frozen base)")
        return self


class TrainRecipe(Strict):
    """A YAML recipe: where the model and text come from, and how to train."""

    model: ModelSource = Field(description="model source: hf | gguf | bundled | random")
    data: DataConfig = Field(default_factory=DataConfig, description="training text")
    train: LoopConfig = Field(default_factory=LoopConfig, description="the training loop")

    def loop_config(self) -> LoopConfig:
        """The loop config with the data loader settings filled in from ``data``."""
        return self.train.model_copy(
            update=dict(
                data_workers=self.data.num_workers,
                pin_memory=self.data.pin_memory,
                prefetch_factor=self.data.prefetch_factor,
                data_seed=self.data.seed,
            )
        )
