"""Model FLOPs per token, the device's peak, and MFU (model FLOPs utilization).

Why: tokens/s alone does not say how far a run is from what the accelerator can do, and it
cannot be compared across model sizes; MFU can (issue 27 measures the trainer by it).

What is counted (PaLM's appendix B, as torchtitan and nanoGPT count it), per trained token:

- every matmul weight costs 2 FLOPs in forward and 2 in backward for its input's gradient, and
  2 more for its own gradient only if it is trained: ``4 * N + 2 * N_trained`` (``6 * N`` for a
  full fine-tune; LoRA/QLoRA's frozen base weights skip their weight gradient). ``N`` leaves out
  the input embedding (a lookup, no matmul); a tied output head is a matmul and counts;
- attention's two matmuls (``Q K^T`` and ``A V``): ``12 * L * (heads * head_dim) * T`` with
  ``T`` the keys each query sees: the window length, or ``sliding_window + global_tokens``
  when a window is narrower (causal masking is not discounted, as in PaLM);
- activation-checkpoint recompute is *not* counted: MFU counts the model's FLOPs, not the work
  the hardware did.

The peak is the device's dense bf16 tensor-core FLOP/s (no 2:4 sparsity), looked up by
``torch.cuda.get_device_name()``; ``logging.peak_tflops`` overrides it. Where neither gives one
(a CPU, an unknown GPU), MFU is ``None`` rather than a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

#: dense bf16 peak TFLOP/s per device, from the vendors' datasheets (sparsity figures halved);
#: each entry's name tokens must all appear in the device name, first match wins (specific first)
BF16_DENSE_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIE"), 756.0),
    (("H100", "NVL"), 835.0),
    (("GH200",), 989.4),
    (("H200", "NVL"), 835.0),
    (("H200",), 989.4),
    (("H100",), 989.4),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (("H800",), 989.4),
    (("H20",), 148.0),
    (("B200",), 2250.0),
    (("A100",), 312.0),
    (("A800",), 312.0),
    (("L40S",), 362.0),
    (("L40",), 181.0),
    (("L4",), 121.0),
    (("A10",), 125.0),
    (("RTX", "4090"), 165.2),
    (("MI300X",), 1307.4),
)


def peak_tflops_for(device_name: str) -> float | None:
    """The table's dense bf16 peak for a device name such as 'NVIDIA H100 80GB HBM3', else None."""
    tokens = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for needed, tflops in BF16_DENSE_PEAK_TFLOPS:
        if all(t in tokens for t in needed):
            return tflops
    return None


@dataclass(frozen=True)
class DevicePeak:
    device_name: str
    tflops: float | None  # per device; None: unknown, MFU is not reported
    source: str  # "config", "table" or "unknown"


def device_peak(device: torch.device, override_tflops: float | None = None) -> DevicePeak:
    """The peak MFU is measured against: the config's, the table's for this CUDA device, or none."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if override_tflops is not None:
        return DevicePeak(name, float(override_tflops), "config")
    tflops = peak_tflops_for(name) if device.type == "cuda" else None
    return DevicePeak(name, tflops, "table" if tflops is not None else "unknown")


def flops_per_token(matmul_params: int, trained_matmul_params: int, n_layers: int, attn_width: int, context: int) -> float:
    """``4 N + 2 N_trained + 12 L (heads * head_dim) T``: forward and backward FLOPs of one token."""
    return 4.0 * matmul_params + 2.0 * trained_matmul_params + 12.0 * n_layers * attn_width * context


@dataclass(frozen=True)
class ModelFlops:
    """The parts of :func:`flops_per_token` that do not depend on the window length."""

    matmul_params: int
    trained_matmul_params: int
    n_layers: int
    attn_width: int
    attention_span: int | None = None  # sliding_window + global_tokens, when a window is set

    def per_token(self, seq_len: int) -> float:
        context = seq_len if self.attention_span is None else min(seq_len, self.attention_span)
        return flops_per_token(self.matmul_params, self.trained_matmul_params, self.n_layers, self.attn_width, context)


def _hf(model: nn.Module) -> nn.Module | None:
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m, "get_input_embeddings"):
            return m
    return None


def model_flops(model: nn.Module, attention_span: int | None = None) -> ModelFlops | None:
    """Count ``model``'s matmul parameters (after LoRA/FSDP wrapping: NF4 and DTensor parameters
    report their full size); None for a model without a transformers config to read its shape."""
    hf = _hf(model)
    config = getattr(hf, "config", None)
    if config is None:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (n_layers and heads and hidden):
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    params = list(model.parameters())  # distinct parameters (a tied head is one)
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    emb = hf.get_input_embeddings()
    out = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    if emb_w is not None and emb_w is not getattr(out, "weight", None):
        total -= emb_w.numel()
        if emb_w.requires_grad:
            trained -= emb_w.numel()
    return ModelFlops(total, trained, int(n_layers), int(heads * head_dim), attention_span)


def mfu(flops: float, seconds: float, peak_tflops: float | None, world: int = 1) -> float | None:
    """Achieved model FLOP/s over the peak of ``world`` devices (0..1), or None without a peak."""
    if peak_tflops is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12 * world)
