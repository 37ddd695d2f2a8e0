"""Resumable checkpoints: torch.distributed.checkpoint (DCP) shards, written atomically.

Layout of ``<output_dir>/checkpoints/step-00000012/``:
- ``dcp/``: model and optimizer state through DCP (each rank writes its own shards; the
  same files load on another world size);
- ``optim-rank<R>.pt``: only for an optimizer that subclasses ``torch.optim.Optimizer`` without
  its per-parameter ``state`` (torchao's ``CPUOffloadOptimizer`` wraps one inner optimizer per
  parameter and never calls ``Optimizer.__init__``, so DCP's ``get_state_dict`` cannot read it):
  that rank's own ``optimizer.state_dict()`` instead of the optimizer's DCP entries, read back
  with ``weights_only=True``; such a checkpoint resumes on the same world size;
- ``trainer_state.json``: step, LR-scheduler, data position, loss-scaler and batch size;
- ``rng-rank<R>.pt``: each rank's torch RNG states (read back with ``weights_only=True``);
- ``COMPLETE``: the marker. Everything is written under ``.step-00000012.tmp`` first; rank 0
  adds the marker and renames the directory only after every rank has finished, so a
  killed run leaves either a complete checkpoint or an ignorable temp dir.

Why trainer state is JSON and not a DCP object: DCP stores non-tensor values as pickles and its
default planner reads them with ``torch.load(weights_only=False)``; plain JSON keeps every load
safe, and :class:`_SafeLoadPlanner` reads the optimizer's few pickled hyper-parameters (``lr``,
``betas``, ...) with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import io
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
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from targets.atomic import atomic_path, atomic_write_json, atomic_write_text, fsync_dir, fsync_tree
from train.errors import TrainInputError

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


def has_standard_state(optimizer) -> bool:
    """Whether ``optimizer`` keeps ``state`` and ``param_groups`` as ``torch.optim.Optimizer`` does,
    which DCP's ``get_state_dict``/``set_state_dict`` read and write directly.

    torchao's ``CPUOffloadOptimizer`` subclasses ``Optimizer`` (for the LR schedulers) but never
    calls ``Optimizer.__init__``: it has no ``state`` (``get_state_dict`` failed with
    "'CPUOffloadOptimizer' object has no attribute 'state'"), only ``state_dict()`` and
    ``load_state_dict()`` over its inner per-parameter optimizers."""
    return isinstance(getattr(optimizer, "state", None), dict) and hasattr(optimizer, "defaults")


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but the non-tensor entries it unpickles are read with ``weights_only=True``.

    The bytes are checked by a ``weights_only=True`` load and handed on re-serialized from what
    that load returned, so the default planner (which loads with ``weights_only=False``) only
    ever sees plain values; this keeps DCP's own bookkeeping of where each value goes."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        safe = torch.load(value, weights_only=True)
        buf = io.BytesIO()
        torch.save(safe, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


def _resync_after_load(optimizer) -> None:
    """Repair what ``CPUOffloadOptimizer.load_state_dict`` (torchao 0.18) leaves stale.

    - It steps a host copy of each large parameter (``param_d2h_map``) and writes that copy back
      over the device weights after every step. The copies were taken when it was built, before
      the checkpoint's weights were loaded: without a refresh the first resumed step would put
      the freshly initialized weights back.
    - Its ``param_groups`` property lists the small parameters' groups from ``d_param_groups``,
      the dicts it built ``d_opt`` with; ``d_opt.load_state_dict`` replaces ``d_opt``'s group dicts,
      so the LR scheduler would write every later learning rate into dicts nothing reads (the
      on-device parameters would train on at the checkpoint's learning rate).
    """
    for p_device, p_host in getattr(optimizer, "param_d2h_map", {}).items():
        with torch.no_grad():
            p_host.copy_(p_device.detach())
    d_opt = getattr(optimizer, "d_opt", None)
    if d_opt is not None and hasattr(optimizer, "d_param_groups"):
        optimizer.d_param_groups = d_opt.param_groups


def _own_optimizer_file(path: Path) -> Path:
    return path / f"optim-rank{_rank()}.pt"


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,  # or one shaped like it (see has_standard_state)
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
    options = StateDictOptions(ignore_frozen_params=skip_frozen)
    if has_standard_state(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        payload = {"model": model_sd, "optim": optim_sd}
    else:
        payload = {"model": get_model_state_dict(model, options=options)}
        with atomic_path(_own_optimizer_file(tmp)) as p:
            torch.save(optimizer.state_dict(), p)
    with _single_process_quiet():
        dcp.save(payload, checkpoint_id=str(tmp / "dcp"))
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
    options = StateDictOptions(ignore_frozen_params=skip_frozen)
    set_options = StateDictOptions(ignore_frozen_params=skip_frozen, strict=not skip_frozen)
    per_rank = any(path.glob("optim-rank*.pt"))
    if has_standard_state(optimizer):
        if per_rank:
            raise TrainInputError(
                f"{path} holds the state of a CPU-offloaded optimizer (optimizer.cpu_offload on CUDA); this run's "
                f"optimizer is a {type(optimizer).__name__}: resume with the optimizer settings that wrote it"
            )
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path / "dcp"), planner=_SafeLoadPlanner())
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=set_options
        )
    else:
        own = _own_optimizer_file(path)
        if not own.is_file():
            why = "another world size" if per_rank else "an optimizer without CPU offload"
            raise TrainInputError(
                f"{path} has no optimizer state for rank {_rank()} of this {type(optimizer).__name__} "
                f"(it was written by {why}): resume with the settings that wrote it"
            )
        state = {"model": get_model_state_dict(model, options=options)}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path / "dcp"), planner=_SafeLoadPlanner())
        set_model_state_dict(model, state["model"], options=set_options)
        optimizer.load_state_dict(torch.load(own, map_location="cpu", weights_only=True))
        _resync_after_load(optimizer)
    rng_file = path / f"rng-rank{_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        log.warning("%s has no RNG state for rank %d (different world size?); RNG not restored", path, _rank())
    return _from_jsonable(json.loads((path / "trainer_state.json").read_text()))
