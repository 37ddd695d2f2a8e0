"""Per-stage checkpoints that make a crashed run resumable.

After stage *i* finishes, its model is saved under ``<run>/stages/<i>-<kind>-<hash>/`` where
the hash covers the model source, data, seed and every stage config up to *i*. A re-run of
the same YAML finds the longest prefix of complete checkpoints and starts after it; editing
stage 3 changes hashes from 3 on, so stages 0-2 are reused and 3+ rerun.

A checkpoint is ``config.json`` + ``model.pt`` (the state dict, loaded with
``weights_only=True``) + ``row.json`` (its report row), written as one atomic directory.
Quantized tensor subclasses round-trip because loading assigns the saved tensors in place.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from targets.atomic import atomic_dir

COMPLETE = "COMPLETE"


def prefix_hash(config_dump: dict, upto: int) -> str:
    """Hash of everything that determines the model after stage ``upto``."""
    key = {
        "model": config_dump.get("model"),
        "data": config_dump.get("data"),
        "seed": config_dump.get("seed"),
        "stages": [_without(s, ("name", "gates")) for s in config_dump.get("stages", [])[: upto + 1]],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _without(d: dict, keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def stage_dir(run_dir: Path, index: int, kind: str, digest: str) -> Path:
    return run_dir / "stages" / f"{index:02d}-{kind}-{digest}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).exists()


def save_stage(path: Path, model: torch.nn.Module, row: dict[str, Any], stage_cfg: dict) -> Path:
    with atomic_dir(path) as tmp:
        (tmp / "config.json").write_text(model.config.to_json_string())
        torch.save(model.state_dict(), tmp / "model.pt")
        (tmp / "row.json").write_text(json.dumps(row, indent=2, default=str))
        (tmp / "stage.json").write_text(json.dumps(stage_cfg, indent=2, default=str))
        (tmp / COMPLETE).write_text("ok\n")
    return path


def load_stage(path: Path, restores: list[Callable[[torch.nn.Module], None]]) -> tuple[torch.nn.Module, dict]:
    """Rebuild the model from its config, re-apply structural changes, then assign weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for restore in restores:
        restore(model)
    state = torch.load(path / "model.pt", map_location="cpu", weights_only=True, mmap=True)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"checkpoint {path} does not fit its model: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        # assign=True leaves two Parameters sharing one storage; make them one Parameter again
        model.tie_weights()
    _materialize_buffers(model, config)
    _freeze_quantized(model)
    model.eval()
    row = json.loads((path / "row.json").read_text())
    return model, row


def _freeze_quantized(model: torch.nn.Module) -> None:
    """``assign=True`` wraps loaded tensors in Parameters that require grad; a quantized tensor
    subclass (integer data inside) must not, or ``torch.export`` refuses it. Stages that quantize
    install them with ``requires_grad=False``; this restores that."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.requires_grad and type(p.data) is not torch.Tensor:
                module._parameters[name] = torch.nn.Parameter(p.data, requires_grad=False)


def load_stage_row(path: Path) -> dict:
    return json.loads((path / "row.json").read_text())


def _materialize_buffers(model: torch.nn.Module, config) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in the state dict; rebuild them on CPU."""
    for name, module in model.named_modules():
        for bname, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                if hasattr(module, "rope_init_fn") or "inv_freq" in bname or "rotary" in name:
                    fresh = type(module)(config=module.config if hasattr(module, "config") else config)
                    for fb_name, fb in fresh.named_buffers(recurse=False):
                        module.register_buffer(fb_name, fb, persistent=False)
                    break
                raise RuntimeError(f"buffer {name}.{bname} has no saved value")
