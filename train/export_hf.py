"""Consolidated Hugging Face export at the end of training, for the pipeline's later stages.

Under FSDP the full state dict is gathered to rank 0 (a collective: every rank calls this);
LoRA/QLoRA adapters are merged into de-quantized base weights, so the result is a plain
``save_pretrained`` directory any stage can load without peft or torchao.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from targets.atomic import atomic_dir
from train.config import LoRAConfig
from train.lora import merged_state_dict, plain_model


def full_state_dict(model: nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def export_pretrained(
    model: nn.Module, tokenizer, out_dir: Path, lora: LoRAConfig, *, sharded: bool, is_main: bool
) -> Path | None:
    """Write ``out_dir`` atomically on rank 0; returns it there (None on other ranks)."""
    state = full_state_dict(model, sharded)
    if not is_main:
        return None
    if lora.enabled:
        state = merged_state_dict(state, lora.alpha, lora.rank)
    hf = plain_model(model)
    if not hasattr(hf, "save_pretrained"):
        raise TypeError(f"{type(hf).__name__} has no save_pretrained; export needs a Hugging Face model")
    state = {k: v.contiguous() for k, v in state.items()}
    with atomic_dir(out_dir) as tmp:
        hf.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out_dir)
