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

The Linears' products stay float32 (:func:`linears_in`): BLAS computes them alike under every ATen
path, the activations they read are float64 values rounded once, and in float64 they were most of
the stage's time. Over SmolLM2's demo recipe (AWQ + 32-window GPTQ) the eager perplexity after GPTQ
spread 0.044 across ``default``/``avx2``/``avx512`` with float32 products, 0.100 with float64 ones
(docs/executorch.md).

``calibration_dtype: auto`` does that on the CPU for models whose float64 copy takes at most
:data:`FLOAT64_AUTO_BYTES`; a larger model, or a GPU, calibrates in the model's own dtype (on a GPU
float64 is slow and the question is another one), and the stage's details say which it used.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal

import torch
from torch import nn

from train.model_parts import forwards_replaced

CalibrationDtype = Literal["auto", "float64", "model"]

#: ``auto`` casts to float64 only while the float64 model takes at most this much memory (512M parameters)
FLOAT64_AUTO_BYTES = 4 * 2**30

DESCRIPTION = (
    "dtype of the calibration forward: float64 makes the result depend far less on the CPU (in fp32 the host's "
    "vector paths change the rounding decisions: 19% of SmolLM2's first six blocks' int4 GPTQ weights differed "
    "between ATEN_CPU_CAPABILITY=default and avx512; none in float64; AWQ's whole stage agrees bit for bit), "
    "with the Linears' products kept in float32 (BLAS computes them alike on every path; SmolLM2's GPTQ stage "
    "took 106 s instead of 140 s with float64 products); model keeps "
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


@contextlib.contextmanager
def linears_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[int]:
    """Every ``nn.Linear`` of ``model`` multiplies in ``dtype`` inside the block: its input and
    weights are rounded to ``dtype``, the product is handed back in the input's dtype.

    Why (GPTQ's float64 calibration): the block forwards' matrix products are most of the stage's
    time, and in float64 they take twice as long as in float32. What makes the fp32 forward depend
    on ``ATEN_CPU_CAPABILITY`` is ATen's own vectorized reductions and transcendental functions
    (norms, softmax, SiLU), not the matrix product, which BLAS computes the same way under every
    ATen path. So the norms, attention and activations stay in float64 and only the products go
    back to the model's own float32: the weights are float32 values already (the cast is exact),
    and the float64 activations round to the same float32 value on every path except where a
    last-bit difference straddles a rounding boundary (about 3e-9 of the elements). Yields the
    number of Linears switched (0 when ``dtype`` is None)."""
    if dtype is None:
        yield 0
        return
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and type(m.weight) is nn.Parameter]

    def in_dtype(lin: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            bias = None if lin.bias is None else lin.bias.to(dtype)
            return nn.functional.linear(x.to(dtype), lin.weight.to(dtype), bias).to(x.dtype)
        return forward

    with forwards_replaced(linears, lambda _i, lin: in_dtype(lin)):
        yield len(linears)


@contextlib.contextmanager
def calibrating_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[str]:
    """:func:`computing_in`, with the Linears' products in float32 where it casts a float32 (or
    narrower) model to float64 (:func:`linears_in`). Yields the dtype's name for the report."""
    products = torch.float32 if dtype == torch.float64 and casts(model, dtype) else None
    with computing_in(model, dtype) as name, linears_in(model, products):
        yield name
