"""Resumable checkpoints: torch.distributed.checkpoint (DCP) shards, written atomically.

Layout of ``<output_dir>/checkpoints/step-00000012/``:
- ``dcp/``: model and optimizer state through DCP (each rank writes its own shards; the
  same files load on another world size);
- ``trainer_state.json``: step, LR-scheduler, data position, loss-scaler and batch size;
- ``rng-rank<R>.pt``: each rank's torch RNG states (read back with ``weights_only=True``);
- ``COMPLETE``: the marker. Everything is written under ``.step-00000012.tmp`` first; rank 0
  adds the marker and renames the directory only after every rank has finished, so a
  killed run leaves either a complete checkpoint or an ignorable temp dir.

Why trainer state is JSON and not a DCP object: DCP stores non-tensor values as pickles and
reads them with ``torch.load(weights_only=False)``; plain JSON keeps every load safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from targets.atomic import atomic_path, atomic_write_json, atomic_write_text, fsync_dir, fsync_tree

log = logging.getLogger("optimize.train")

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{8})$")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it 'assumes a single process' on every non-distributed save and load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (marker present), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and (child / MARKER).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _jsonable(obj):
    """Scalar tensors (torchao keeps ``lr`` as a tensor, so schedulers hold tensors) survive JSON."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _from_jsonable(obj):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        return {k: _from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_jsonable(v) for v in obj]
    return obj


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    keep_last: int = 2,
    skip_frozen: bool = False,
) -> Path:
    """Collective on every rank: write step ``step`` atomically, then prune to ``keep_last``.

    ``skip_frozen`` leaves frozen parameters out (LoRA/QLoRA): they never change, and the
    resumed run rebuilds them bit-identically from the model source.
    """
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a killed run
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=skip_frozen))
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    with atomic_path(tmp / f"rng-rank{rank}.pt") as p:
        torch.save(_rng_state(), p)
    _barrier()
    if rank == 0:
        atomic_write_json(tmp / "trainer_state.json", _jsonable({"step": step, **trainer_state}))
        atomic_write_text(tmp / MARKER, f"step {step}\n")
        fsync_tree(tmp)  # the DCP shards too: the rename must not outrun their data
        if final.exists():  # re-saving the same step (e.g. final == interval): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        for _, old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    log.info("checkpoint saved: %s", final)
    return final


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, skip_frozen: bool = False
) -> dict:
    """Collective: restore model, optimizer and this rank's RNG; return the trainer state."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=skip_frozen))
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(ignore_frozen_params=skip_frozen, strict=not skip_frozen),
    )
    rng_file = path / f"rng-rank{_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        log.warning("%s has no RNG state for rank %d (different world size?); RNG not restored", path, _rank())
    return _from_jsonable(json.loads((path / "trainer_state.json").read_text()))
