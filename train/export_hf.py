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


def _gather_stages(model: nn.Module, stages) -> dict[str, torch.Tensor]:
    """Every pipeline stage's full parameters, on global rank 0 (empty elsewhere): each stage
    gathers its own over dp/tp, then one rank per stage sends them to rank 0."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    own = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    sends = stages.dp_rank == 0 and stages.tp_rank == 0
    own = {k: v.detach().cpu() for k, v in own.items()} if sends else {}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own, parts, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for part in parts or []:
        merged.update(part)
    return merged


def full_state_dict(model: nn.Module, sharded: bool, stages=None) -> dict[str, torch.Tensor]:
    """The whole model's state on rank 0; ``stages``: the ParallelMesh of a pipeline-parallel run."""
    if stages is not None:
        return _gather_stages(model, stages)
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def export_pretrained(
    model: nn.Module, tokenizer, out_dir: Path, lora: LoRAConfig, *, sharded: bool, is_main: bool, stages=None
) -> Path | None:
    """Write ``out_dir`` atomically on rank 0; returns it there (None on other ranks).

    ``stages`` (the ParallelMesh of a pipeline-parallel run): rank 0 holds one stage's modules only,
    so the directory is written from a weightless copy of the whole model and the gathered state."""
    state = full_state_dict(model, sharded, stages)
    if not is_main:
        return None
    if lora.enabled:
        state = merged_state_dict(state, lora.alpha, lora.rank)
    hf = plain_model(model)
    if stages is not None:
        from train.model_parts import meta_model

        hf = meta_model(hf.config)
    if not hasattr(hf, "save_pretrained"):
        raise TypeError(f"{type(hf).__name__} has no save_pretrained; export needs a Hugging Face model")
    state = {k: v.contiguous() for k, v in state.items()}
    with atomic_dir(out_dir) as tmp:
        hf.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out_dir)
