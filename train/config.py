"""Typed configs for every trainer component; a recipe is these blocks plus a model source.

Each block is a :class:`Strict` model, so a typo in YAML names the allowed keys. The
blocks are small on purpose: the pipeline's ``distill`` and ``qat`` stages build a
:class:`LoopConfig` in Python and never touch YAML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from targets.config_base import Strict
from train.parallel.config import ParallelConfig, parallel_conflicts
from targets.sources import ModelSource
from train.tracking import TrackingConfig


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
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="dense bf16 peak of one device in TFLOP/s, the denominator of MFU; null looks it up by CUDA "
        "device name (H100/H200 SXM 989, A100 312, ...; see train/flops.py) and leaves MFU null on CPU or an "
        "unknown device",
    )


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


class AttentionConfig(Strict):
    """Attention at training time; see ``train/attention.py`` for what each choice runs."""

    backend: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] | None = Field(
        None,
        description="attention implementation: sdpa (default), eager (matmul + softmax), flash_attention_2 "
        "(flash-attn package, CUDA only), flex_attention (block-sparse masks; no backward on CPU in torch 2.13); "
        "null keeps the model's (model.attn_implementation in a recipe), except that on CUDA with the flash-attn "
        "package installed and fp16/bf16 compute it picks flash_attention_2",
    )
    sdpa_kernel: Literal["auto", "flash", "efficient", "cudnn", "math"] = Field(
        "auto",
        description="restrict SDPA to one kernel (torch.nn.attention.sdpa_kernel); CPU has flash and math, "
        "CUDA also efficient and cudnn; auto lets the dispatcher choose",
    )
    sliding_window: int | None = Field(
        None, ge=1, description="each token attends to itself and the sliding_window - 1 tokens before it"
    )
    global_tokens: int = Field(
        0,
        ge=0,
        description="local+global sparse pattern: the first global_tokens positions of every window stay visible "
        "to all queries (attention sinks); needs sliding_window",
    )
    window_impl: Literal["auto", "blockwise", "mask"] = Field(
        "auto",
        description="blockwise: SDPA per query block over its key band, O(T*window) memory (sdpa only); "
        "mask: the pattern ANDed onto the model's causal mask (dense for sdpa/eager, a BlockMask for "
        "flex_attention, window_size for flash-attn); auto: blockwise on sdpa, else mask",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "AttentionConfig":
        if self.global_tokens and self.sliding_window is None:
            raise ValueError("global_tokens adds global positions to a sliding window; set sliding_window too")
        if self.window_impl != "auto" and self.sliding_window is None:
            raise ValueError(f"window_impl {self.window_impl} needs sliding_window")
        if self.sdpa_kernel != "auto" and self.backend not in (None, "sdpa"):
            raise ValueError(f"sdpa_kernel {self.sdpa_kernel} applies to backend sdpa, not {self.backend}")
        if self.window_impl == "blockwise" and self.backend not in (None, "sdpa"):
            raise ValueError(f"window_impl blockwise runs on SDPA; backend is {self.backend}")
        if self.backend == "flash_attention_2" and self.global_tokens:
            raise ValueError("flash-attn has sliding windows but no global tokens; use backend sdpa for global_tokens")
        return self


class LossConfig(Strict):
    chunked: bool = Field(
        True,
        description="compute the LM loss through lm_head chunk by chunk (fused with its gradient), never holding "
        "full [tokens, vocab] logits; equal to the plain loss to float tolerance",
    )
    chunk_size: int = Field(1024, ge=16, description="tokens per chunk (the live logits are chunk_size x vocab fp32)")


class CompileConfig(Strict):
    """``torch.compile`` at training time; see ``train/compile.py``."""

    enabled: bool = Field(
        False, description="compile each transformer block in place (torchtitan's per-block torch.compile)"
    )
    loss: bool = Field(True, description="also compile the default loss (the chunked cross-entropy's per-chunk math)")
    mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        "default",
        description="torch.compile mode; CUDA-graph modes are left out (they clash with FSDP2 and changing lengths)",
    )


class CurriculumStage(Strict):
    until_step: int = Field(ge=1, description="use this length up to and including this optimizer step")
    seq_len: int = Field(ge=8, description="tokens per packed window during this stage")


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
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="the device mesh: dp_shard, tp, pp and ep sizes (torchrun jobs)"
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints and export")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="metrics output")
    attention: AttentionConfig = Field(default_factory=AttentionConfig, description="attention kernel and pattern")
    loss: LossConfig = Field(default_factory=LossConfig, description="the default next-token loss")
    compile: CompileConfig = Field(
        default_factory=CompileConfig,
        description="torch.compile per transformer block and of the loss; `compile: true` is short for "
        "`compile: {enabled: true}`",
    )
    curriculum: list[CurriculumStage] = Field(
        default_factory=list,
        description="sequence-length curriculum: stages of increasing length (each until_step, seq_len); "
        "after the last stage the run uses the full length (data.seq_len)",
    )
    data_workers: int = Field(0, ge=0, description="DataLoader workers (copied from data.num_workers by recipes)")
    pin_memory: bool = Field(False, description="pin host batches (copied from data.pin_memory by recipes)")
    prefetch_factor: int | None = Field(None, ge=1, description="per-worker prefetch (copied from data by recipes)")
    data_seed: int = Field(0, description="shuffle seed (copied from data.seed by recipes)")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_shorthand(cls, value):
        if isinstance(value, bool):
            return {"enabled": value}
        if isinstance(value, (dict, CompileConfig)):
            return value
        raise ValueError(f"compile takes true, false or a mapping with enabled, loss and mode; got {value!r}")

    @model_validator(mode="after")
    def _parallel_consistent(self) -> "LoopConfig":
        parallel_conflicts(self)
        return self

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
        if self.device == "cpu" and self.attention.backend == "flash_attention_2":
            raise ValueError(
                "attention.backend flash_attention_2 needs CUDA and device is cpu; use sdpa (its flash kernel runs on CPU)"
            )
        for prev, cur in zip(self.curriculum, self.curriculum[1:]):
            if cur.until_step <= prev.until_step or cur.seq_len <= prev.seq_len:
                raise ValueError(
                    "curriculum stages must grow: until_step and seq_len both strictly increasing, got "
                    f"(until_step {prev.until_step}, seq_len {prev.seq_len}) then "
                    f"(until_step {cur.until_step}, seq_len {cur.seq_len})"
                )
        return self


class TrainRecipe(Strict):
    """A YAML recipe: where the model and text come from, and how to train."""

    model: ModelSource = Field(description="model source: hf | gguf | bundled | random")
    data: DataConfig = Field(default_factory=DataConfig, description="training text")
    train: LoopConfig = Field(default_factory=LoopConfig, description="the training loop")
    tracking: TrackingConfig | None = Field(
        None, description="experiment tracking: tracking.mlflow records the recipe, per-step loss, tokens/s and "
        "memory, and report.json in MLflow (the optional `tracking` extra)"
    )

    @model_validator(mode="after")
    def _fits_the_context(self) -> "TrainRecipe":
        window = self.train.attention.sliding_window
        if window is not None and window >= self.data.seq_len:
            raise ValueError(
                f"train.attention.sliding_window {window} must be smaller than the training context data.seq_len "
                f"{self.data.seq_len} (a window covering the whole context is plain causal attention)"
            )
        for stage in self.train.curriculum:
            if stage.seq_len >= self.data.seq_len:
                raise ValueError(
                    f"train.curriculum: stage seq_len {stage.seq_len} must be shorter than data.seq_len "
                    f"{self.data.seq_len}, the full length the run ends with"
                )
        att = self.train.attention
        backend = att.backend or self.model.attn_implementation
        if backend == "flash_attention_2" and self.train.device == "cpu":
            raise ValueError("model.attn_implementation flash_attention_2 needs CUDA and train.device is cpu")
        if backend != "sdpa" and (att.sdpa_kernel != "auto" or att.window_impl == "blockwise"):
            what = f"sdpa_kernel {att.sdpa_kernel}" if att.sdpa_kernel != "auto" else "window_impl blockwise"
            raise ValueError(f"train.attention.{what} needs SDPA, but the model's attention is {backend}")
        return self

    def _attention_backend(self) -> str | None:
        """The loop's backend: the train block's, else the model's unless that is the default sdpa, which
        the source already applied where the family has it (Gemma-2 has none and loads eager: asking the
        loop for sdpa again would refuse a recipe that trains fine)."""
        if self.train.attention.backend is not None:
            return self.train.attention.backend
        return None if self.model.attn_implementation == "sdpa" else self.model.attn_implementation

    def loop_config(self) -> LoopConfig:
        """The loop config with the data loader settings filled in from ``data``."""
        return self.train.model_copy(
            update=dict(
                data_workers=self.data.num_workers,
                pin_memory=self.data.pin_memory,
                prefetch_factor=self.data.prefetch_factor,
                data_seed=self.data.seed,
                attention=self.train.attention.model_copy(update=dict(backend=self._attention_backend())),
            )
        )
