"""The exported-precision check: which quantization scheme each Linear holds in the eager model
(torchao tensor subclasses), and whether an exported graph computes the same mix.

Runtime-neutral: each runtime package reads its own graph (ExecuTorch's in
:func:`export.executorch.quant.exported_linear_schemes`). The ExecuTorch exporter compares the two and refuses a program whose mix differs from the one the
stages chose; the manifest and the report carry the exported mix.
"""

from __future__ import annotations

from collections import Counter

import torch

from export.base import ExportError
from export.group_offset import GroupOffsetLinear


def linear_scheme(weight: torch.Tensor) -> str:
    """Name the scheme of one Linear weight: fp32, 8da4w, 8da8w, int8wo or the subclass name."""
    cls = type(weight)
    if cls in (torch.Tensor, torch.nn.Parameter):
        return "fp32" if weight.dtype == torch.float32 else str(weight.dtype).replace("torch.", "")
    name = cls.__name__
    if name == "IntxUnpackedToInt8Tensor":
        bits = str(getattr(weight, "target_dtype", "")).replace("torch.", "")
        if getattr(weight, "activation_quantization", None) is None:
            return f"{bits}wo"
        return {"int4": "8da4w", "int8": "8da8w"}.get(bits, f"8da{bits}")
    if name in ("Int8Tensor", "AffineQuantizedTensor"):
        return "int8wo" if getattr(weight, "act_quant_kwargs", None) is None else name
    return name


def module_schemes(model: torch.nn.Module) -> dict[str, str]:
    """Each nn.Linear's scheme in the eager model, by module name."""
    return {f: linear_scheme(m.weight) for f, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def quantization_mix(model: torch.nn.Module) -> dict[str, int]:
    """How many nn.Linear layers hold each scheme (for the report and the manifest); the small
    offset Linears of a kept source grid (:class:`~export.group_offset.GroupOffsetLinear`) are
    counted apart, as ``offset <scheme>``."""
    offsets = {f"{n}.offset" for n, m in model.named_modules() if isinstance(m, GroupOffsetLinear)}
    return dict(Counter(f"offset {s}" if n in offsets else s for n, s in module_schemes(model).items()))


def check_mix(eager: dict[str, str], graph: dict[str, str]) -> None:
    """Refuse to ship a program whose linears do not compute the schemes the model was given."""
    wrong = {k: (v, graph.get(k)) for k, v in eager.items() if k in graph and graph[k] != v}
    if wrong:
        name, (want, got) = next(iter(wrong.items()))
        raise ExportError(
            f"{len(wrong)} Linear layers lost their quantization in torch.export (e.g. {name}: {want} in eager, "
            f"{got} in the graph); the .pte would not have the mix the stages chose"
        )


def mix_details(schemes: dict[str, str]) -> dict:
    """Counts per scheme, and the module names of every scheme but the most common one."""
    counts = Counter(schemes.values())
    if not counts:
        return {"counts": {}, "modules": {}}
    major = counts.most_common(1)[0][0]
    return {"counts": dict(counts), "majority": major,
            "modules": {s: sorted(n for n, v in schemes.items() if v == s) for s in counts if s != major}}
