"""Calibrate in float64 so a recipe's model depends less on the CPU it ran on.

The calibration stages read activations and round weights: GPTQ moves every rounding error onto
the columns after it, AWQ picks each group's exponent by a quantized error and folds a scale into
the weights. In fp32 the activations differ in their last bits between the CPU's vector paths
(``ATEN_CPU_CAPABILITY`` default/avx2/avx512: reductions summed in another order, ``exp``/``pow``
from another library), and so do the decisions: between two paths of one machine, 19% of
SmolLM2's int4 GPTQ weights (first six blocks) and 266 of its AWQ-scaled weight tensors came out
different, and the all-4-bit recipe landed anywhere from +8.8% to +12.4% perplexity by host.
Run the calibration forward in float64 and the last-bit differences shrink by eight orders of
magnitude: the AWQ stage on SmolLM2 and GPTQ on its first six blocks give identical weights on both
paths (``tests/optimize/quant/test_gptq_host.py`` on a tiny model). Over a whole model GPTQ can still
meet one rounding decision the remaining difference flips, and its error feedback carries that flip
on (docs/executorch.md, "GPTQ depends on the host"): fewer host differences, not none.

``calibration_dtype: auto`` does that on the CPU for models whose float64 copy takes at most
:data:`FLOAT64_AUTO_BYTES`; a larger model, or a GPU, calibrates in the model's own dtype (on a GPU
float64 is slow and the question is another one), and the stage's details say which it used.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal

import torch
from torch import nn

CalibrationDtype = Literal["auto", "float64", "model"]

#: ``auto`` casts to float64 only while the float64 model takes at most this much memory (512M parameters)
FLOAT64_AUTO_BYTES = 4 * 2**30

DESCRIPTION = (
    "dtype of the calibration forward: float64 makes the result depend far less on the CPU (in fp32 the host's "
    "vector paths change the rounding decisions: 19% of SmolLM2's first six blocks' int4 GPTQ weights differed "
    "between ATEN_CPU_CAPABILITY=default and avx512; none in float64; AWQ's whole stage agrees bit for bit), "
    "for about 1.3x the stage's time; model keeps "
    "the model's dtype; auto: float64 on the CPU when the model in float64 takes at most 4 GiB (512M "
    "parameters), else the model's dtype"
)


def resolve(model: nn.Module, choice: CalibrationDtype, device: torch.device | None) -> torch.dtype | None:
    """The dtype to calibrate in, or None for the model's own."""
    subclassed = any(type(p.data) is not torch.Tensor for p in model.parameters())  # torchao tensors already in
    if choice == "model":
        return None
    if choice == "float64":
        if subclassed:
            raise ValueError("calibration_dtype float64: the model already holds quantized (torchao) weights, "
                             "which cannot be cast; use calibration_dtype: model")
        return torch.float64
    if subclassed:
        return None
    on_cpu = device is None or torch.device(device).type == "cpu"
    params = sum(p.numel() for p in model.parameters())
    return torch.float64 if on_cpu and params * 8 <= FLOAT64_AUTO_BYTES else None


def _floating_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.is_floating_point()}


def casts(model: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether :func:`computing_in` casts ``model`` for ``dtype`` (a caller that must not put
    tensors into the model while it is cast asks this first)."""
    return dtype is not None and _floating_dtypes(model) != {dtype}


@contextlib.contextmanager
def computing_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[str]:
    """The model cast to ``dtype`` inside the block and back to its own dtype after it, on any exit.

    Both casts are exact (fp32/bf16/fp16 values are float64 values, and what the stage writes into
    the weights meanwhile are values of the model's own dtype). Yields the dtype's name for the report."""
    own = _floating_dtypes(model)
    if not casts(model, dtype):
        yield str(next(iter(own), torch.float32)).removeprefix("torch.")
        return
    if len(own) != 1:
        raise ValueError(f"calibration in {dtype} needs one floating dtype in the model, found {sorted(map(str, own))}")
    (home,) = own
    model.to(dtype)
    try:
        yield str(dtype).removeprefix("torch.")
    finally:
        model.to(home)
