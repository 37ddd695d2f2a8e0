"""Which quantization scheme each Linear holds: in the eager model (torchao tensor subclasses)
and in the exported graph (what ExecuTorch's XNNPACK partitioner will lower).

The exporter compares the two and refuses a program whose mix differs from the one the
stages chose; the manifest and the report carry the exported mix.
"""

from __future__ import annotations

from collections import Counter

import torch

from export.base import ExportError


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
    """How many nn.Linear layers hold each scheme (for the report and the manifest)."""
    return dict(Counter(module_schemes(model).values()))


_BITS = {(-8, 7): 4, (-128, 127): 8}


def exported_linear_schemes(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """The scheme each ``aten.linear`` of the exported graph really computes, by module name.

    Read from the graph, not the eager model: a weight that reaches the linear through
    ``torchao.dequantize_affine`` with int4 or int8 bounds is quantized, an input that went
    through ``quantize_affine`` -> ``dequantize_affine`` is the dynamic int8 activation. This is
    what the XNNPACK partitioner pattern-matches, so it is what the .pte runs.
    """
    from export.executorch_delegable import NORM_MEAN_BUFFER
    from export.executorch_fusion import member_path

    buffers = ep.graph_signature.inputs_to_buffers
    out: dict[str, str] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        weight = node.args[1]
        while isinstance(weight, torch.fx.Node) and weight.target in (torch.ops.aten.to.dtype,
                                                                      torch.ops.aten._to_copy.default):
            weight = weight.args[0]
        if isinstance(weight, torch.fx.Node) and buffers.get(weight.name, "").rsplit(".", 1)[-1].startswith(
                NORM_MEAN_BUFFER):
            continue  # RMSNorm's mean as a linear (export/executorch_delegable.py), not a layer
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else node.name
        path = path.split(".", 1)[1] if path.startswith("model.") else path  # the export wrapper's attribute
        path = member_path(path)  # a fused q/k/v or gate/up member, named as in the eager model
        w, x = node.args[1], node.args[0]
        bits = None
        if isinstance(w, torch.fx.Node) and w.op == "call_function" and "dequantize_affine" in str(w.target):
            bits = _BITS.get((w.args[-2], w.args[-1]))
        dyn = isinstance(x, torch.fx.Node) and "dequantize_affine" in str(x.target)
        if bits is None:
            out[path] = "fp32"
        else:
            out[path] = f"8da{bits}w" if dyn else f"int{bits}wo"
    return out


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
