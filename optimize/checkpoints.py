"""Per-stage checkpoints that make a crashed run resumable.

After stage *i* finishes, its model is saved under ``<run>/stages/<i>-<kind>-<hash>/`` where
the hash covers the model source, data, seed and every stage config up to *i*. A re-run of
the same YAML finds the longest prefix of complete checkpoints and starts after it; editing
stage 3 changes hashes from 3 on, so stages 0-2 are reused and 3+ rerun.

A checkpoint is ``config.json`` + ``model.pt`` (the state dict, loaded with
``weights_only=True``) + ``row.json`` (its report row), written as one atomic directory.
Quantized tensor subclasses round-trip because loading assigns the saved tensors in place.
Non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``, BERT's ``position_ids``)
are not in the state dict: the model is rebuilt with its parameters on the meta device but its
buffers real, so its own constructor computes them. A checkpoint that cannot be used raises
:class:`CheckpointError` naming it (a pickle that asks for code is refused, never run).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from targets.atomic import atomic_dir
from targets.sources.weight_files import unsafe_pickle_reason

COMPLETE = "COMPLETE"
_REDO = "delete {path} to run that stage again, or set resume: false"


class CheckpointError(RuntimeError):
    """A stage checkpoint cannot be resumed from; the message names it and how to go on."""


def prefix_hash(config_dump: dict, upto: int) -> str:
    """Hash of everything that determines the model after stage ``upto``."""
    key = {
        "model": config_dump.get("model"),
        "data": config_dump.get("data"),
        "seed": config_dump.get("seed"),
        "stages": [_without(s, ("name", "gates")) for s in config_dump.get("stages", [])[: upto + 1]],
    }
    if config_dump.get("compute_dtype") is not None:  # bf16 weights are another model; the device is not
        key["compute_dtype"] = config_dump["compute_dtype"]
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
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = _skeleton(config)
    for restore in restores:
        restore(model)
    state = _read_state(path / "model.pt")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not fit its model: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; {_REDO.format(path=path)}"
        )
    if getattr(config, "tie_word_embeddings", False):
        # assign=True leaves two Parameters sharing one storage; make them one Parameter again
        model.tie_weights()
    _check_materialized(model, path)
    _freeze_quantized(model)
    model.eval()
    row = json.loads((path / "row.json").read_text())
    return model, row


def _read_state(file: Path) -> dict:
    """``torch.load(weights_only=True)``: a pickle that asks for code is refused, never run."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        text = str(exc).strip()
        why = unsafe_pickle_reason(exc) or f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        raise CheckpointError(f"stage checkpoint {file} cannot be loaded: {why}; {_REDO.format(path=file.parent)}") from None


def _skeleton(config) -> torch.nn.Module:
    """The model freshly built from ``config`` with its parameters on the meta device (no memory,
    no init) but its buffers real, on CPU. Non-persistent buffers are not in the state dict, so
    they must come from the model's own constructor: rotary ``inv_freq``, Gemma's
    ``embed_scale``, BERT's ``position_ids`` and whatever a future architecture adds."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config)


def _check_materialized(model: torch.nn.Module, path: Path) -> None:
    """Every tensor must hold data after loading; a meta one would fail later, far from here."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise CheckpointError(
                    f"checkpoint {path}: {kind} {name} has no saved value and its module did not rebuild it "
                    "(a stage's restore hook must recreate what it added)"
                )


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
