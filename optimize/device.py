"""Where a pipeline run computes: its ``device`` and ``compute_dtype``, and moving models,
blocks and tensors there.

Why a module of its own: the config validates the words (``auto|cpu|cuda``), the pipeline
places the model, the stages move their calibration data to the model and the checks time
CUDA work; one definition keeps them agreeing on what ``auto`` means and on what moves.

The pipeline owns the model's placement (:func:`place`): the whole model goes to the run's
device and dtype before the baseline, stays there through the stages and their checks, and
comes back to the CPU, in the dtype it was loaded in, for the export. A stage that calibrates
block by block (GPTQ) moves one decoder block at a time to its compute device
(:func:`on_device`), so a caller that keeps a large model on the CPU does not need it on the
GPU whole.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal

import torch
from torch import nn

from optimize.errors import ConfigError

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(ConfigError):
    """The config asks for a device this machine does not have: a problem at the YAML path
    ``device``, told in one line (the machine lacks something, not the file)."""

    def __init__(self, source: str, why: str):
        super().__init__(source, [("device", why)])
        self.args = (f"{source}: {why}",)

    def __str__(self) -> str:
        return self.args[0]


def cuda_missing(name: str) -> str | None:
    """Why ``device: <name>`` cannot run here, or None."""
    if name == "cuda" and not torch.cuda.is_available():
        return ("device: cuda, but this machine has no usable CUDA device (torch.cuda.is_available() is False); "
                "use device: auto or cpu")
    return None


def resolve_device(name: DeviceName, source: str = "config") -> torch.device:
    """``auto`` is CUDA where ``torch.cuda.is_available()``, else the CPU; ``cuda`` without CUDA
    is refused (:class:`DeviceError` naming ``source``, the config)."""
    why = cuda_missing(name)
    if why:
        raise DeviceError(source, why)
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 when it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def model_device(model: nn.Module) -> torch.device:
    """Where the model's first parameter lives (the CPU when it has none)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same place when 0 is the current device."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def place(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """Move ``model`` (in place) to ``device`` and cast its floating-point parameters to ``dtype``
    (None keeps them). Nothing is copied when it is already there.

    Buffers keep their dtype: a model loaded in bf16 keeps its rotary ``inv_freq`` in fp32, and
    a cast here must not lose what loading in that dtype would have kept. Tied parameters stay
    one parameter."""
    if not same_device(model_device(model), device):
        model.to(device)
    if dtype is not None:
        _cast_parameters(model, dtype)
    return model


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in cast:
                cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = cast[id(p)]


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside it (tuples, lists, dicts, nested) moved to ``device``;
    a model's recorded call arguments (masks, rotary tables, cache positions) for one block."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return type(obj)(*(to_device(o, device) for o in obj)) if hasattr(obj, "_fields") else tuple(
            to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def on_device(module: nn.Module, device: torch.device | None) -> Iterator[nn.Module]:
    """While open, ``module`` (one decoder block) lives on ``device``; afterwards it goes back to
    where it was. A no-op when ``device`` is None or the module is already there."""
    home = model_device(module)
    if device is None or same_device(home, device):
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a timer must not stop early)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
