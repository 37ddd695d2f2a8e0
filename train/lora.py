"""LoRA through peft, QLoRA by storing the frozen base weights as torchao NF4, and the merge.

QLoRA here is peft's LoRA layers over a base ``nn.Linear`` whose weight is an
``NF4Tensor`` parameter (torchao's ``to_nf4``): ``F.linear`` on it dispatches to torchao's
``LinearNF4``, which de-quantizes per call and never computes a base-weight gradient.
``NF4Tensor`` implements FSDP2's ``fsdp_pre/post_all_gather``, so FSDP2 shards and
all-gathers the 4-bit data itself (per-parameter sharding of quantized weights).

The merge works on a *state dict* (full, gathered) so it is the same code with or without
FSDP: ``W = dequant(base) + B @ A * alpha / r``, peft prefixes and ``base_layer`` removed.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from train.config import LoRAConfig

log = logging.getLogger("optimize.train")

_PEFT_PREFIX = "base_model.model."


def apply_lora(model: nn.Module, cfg: LoRAConfig, shard_world: int = 1) -> nn.Module:
    """Freeze the model, add adapters, and (for QLoRA) turn the adapted base weights into NF4."""
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    targets = [t for t in cfg.target_modules if t in present]
    if not targets:
        raise ValueError(f"lora.target_modules {cfg.target_modules} match no Linear layer; this model has {sorted(present)}")
    peft_cfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none")
    model = get_peft_model(model, peft_cfg)
    if cfg.quantize_base == "nf4":
        n, skipped = quantize_base_nf4(model, cfg.nf4_block_size, shard_world)
        log.info("QLoRA: %d base weights stored as NF4 (%d left in full precision: shape not divisible)", n, skipped)
    return model


def _scaler_block(n_blocks: int, world: int) -> int | None:
    """Largest power-of-two scaler block (<= 256) that divides every rank's share of blocks."""
    if n_blocks % world:
        return None
    per_rank = n_blocks // world
    size = 256
    while size >= 1:
        if per_rank % size == 0:
            return size
        size //= 2
    return None


def quantize_base_nf4(model: nn.Module, block_size: int = 64, shard_world: int = 1) -> tuple[int, int]:
    """Replace each LoRA base weight with a frozen NF4 parameter; returns (quantized, skipped)."""
    from peft.tuners.lora import LoraLayer
    from torchao.quantization import to_nf4

    done = skipped = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        w = base.weight
        rows_ok = w.shape[0] % shard_world == 0
        scaler = _scaler_block(w.numel() // block_size, shard_world) if w.numel() % block_size == 0 else None
        if w.dim() != 2 or not rows_ok or scaler is None or (w.shape[0] // shard_world * w.shape[1]) % block_size:
            skipped += 1
            continue
        nf4 = to_nf4(w.detach().contiguous(), block_size, scaler)
        base.weight = nn.Parameter(nf4, requires_grad=False)
        done += 1
    return done, skipped


def dequantize(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if type(t).__name__ == "NF4Tensor":
        return t.get_original_weight().to(dtype)
    return t


def merged_state_dict(state: dict[str, torch.Tensor], alpha: float, rank: int, adapter: str = "default") -> dict:
    """Fold ``lora_A/lora_B`` into the base weights of a full peft state dict; plain HF keys out."""
    scale = alpha / rank
    out: dict[str, torch.Tensor] = {}
    pat = re.compile(rf"^(.*)\.lora_[AB]\.{re.escape(adapter)}\.weight$")
    for key, value in state.items():
        if pat.match(key) or ".lora_" in key:
            continue
        name = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
        if ".base_layer." in name:
            owner = key.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            value = dequantize(value)
            a = state.get(f"{owner}.lora_A.{adapter}.weight")
            b = state.get(f"{owner}.lora_B.{adapter}.weight")
            if a is not None and b is not None and name.endswith(".weight"):
                value = (value.float() + (b.float() @ a.float()) * scale).to(value.dtype)
        out[name] = dequantize(value)
    return out


def plain_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (the one with ``save_pretrained`` and config)."""
    if hasattr(model, "peft_config"):
        return model.base_model.model
    return model
