"""Exporter-side quantization for the ExecuTorch target (torchao, the layouts XNNPACK lowers).

``quantize`` (8da4w / 8da8w) and ``lm_head`` act on nn.Linear; ``embedding_quantize`` stores the
token table weight-only (int8 per row, int4 per group) for the portable quantized-embedding
kernel; int8 weight-only Linear layers are refused (XNNPACK returns wrong logits for them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from export.base import ExportError
from export.executorch.delegable import NORM_MEAN_BUFFER
from export.executorch.fusion import member_path
from export.precision import linear_scheme, module_schemes, quantization_mix
from targets.group_size import embedding_width_error, widths_error

if TYPE_CHECKING:
    from export.executorch.options import ExecuTorchOptions


def _is_lm_head(fqn: str) -> bool:
    return fqn == "lm_head" or fqn.endswith(".lm_head")


#: module names that hold a layer's attention projections, across the supported families (Llama's
#: self_attn, GPT-2's attn, GPT-NeoX's attention, ...)
ATTENTION_MODULES = frozenset({"attn", "self_attn", "attention", "self_attention"})


def is_attention(fqn: str) -> bool:
    """Whether a Linear is one of its layer's attention projections (q/k/v/o, fused or not)."""
    return not ATTENTION_MODULES.isdisjoint(fqn.split(".")[:-1])


def _refuse_weight_only(model: torch.nn.Module) -> None:
    bad = [f for f, m in model.named_modules() if isinstance(m, torch.nn.Linear) and linear_scheme(m.weight).endswith("wo")]
    if bad:
        raise ExportError(
            f"{len(bad)} Linear layers (e.g. {bad[0]}) hold weight-only quantized weights "
            f"({linear_scheme(dict(model.named_modules())[bad[0]].weight)}); lowered to XNNPACK, int8 "
            "weight-only returns wrong logits (executorch 1.4.1/1.5.1). Use 8da8w or 8da4w instead."
        )


#: bytes per weight each Linear scheme stores (scales included, roughly)
_SCHEME_BYTES = {"fp32": 4.0, "8da8w": 1.0, "8da4w": 0.5625}
#: ``embedding_quantize: auto`` quantizes the table when it would be at least this share of the program
AUTO_EMBEDDING_SHARE = 0.25


def _auto_embedding(model: torch.nn.Module) -> dict:
    """``embedding_quantize: auto``: int8 per row when the Linear layers are quantized and the fp32
    table would be at least :data:`AUTO_EMBEDDING_SHARE` of the program (SmolLM2 8da4w: 58%;
    a 262k-vocabulary model: most of it). Measured on SmolLM2-135M (eager, the reference
    perplexity 14.711, each tensor quantized alone): embedding int8 per row 14.706 (-0.03%), int4
    g32 14.852 (+0.96%), int4 g64 14.962 (+1.70%); lm_head 8da8w 14.853 (+0.97%), 8da4w g32 16.460
    (+11.9%). int8 per row is free and quarters the table, so it is the default; int4 is an option.
    fp32 exports and already-quantized tables stay as they are."""
    emb = model.get_input_embeddings()
    schemes = module_schemes(model)
    if linear_scheme(emb.weight) != "fp32" or all(v == "fp32" for v in schemes.values()):
        return {"choice": None, "share": None}
    mods = dict(model.named_modules())
    rest = sum(mods[f].weight.shape[0] * mods[f].weight.shape[1] * _SCHEME_BYTES.get(v, 4.0) for f, v in schemes.items())
    table = emb.weight.numel() * 4.0
    share = table / (table + rest)
    return {"choice": "int8" if share >= AUTO_EMBEDDING_SHARE else None, "share": round(share, 3)}


def apply_quantization(model: torch.nn.Module, opts: ExecuTorchOptions) -> dict:
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
        PerAxis,
        PerGroup,
        quantize_,
    )

    cfg_8da8w = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    if opts.quantize != "none":
        already = {s for s in quantization_mix(model) if s != "fp32"}
        if already:
            raise ExportError(
                f"quantize={opts.quantize!r} but the model is already quantized ({', '.join(sorted(already))}); "
                "set quantize: none to export it as given"
            )
        main = (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(opts.group_size))
            if opts.quantize == "8da4w"
            else cfg_8da8w
        )
        choice = {"same": main, "fp32": None, "8da8w": cfg_8da8w}  # lm_head's and attention's options
        by_role = {"head": choice[opts.lm_head], "attention": choice[opts.attention], "body": main}

        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        heads = {f for f, m in model.named_modules() if out is not None and m is out}  # GPT-NeoX: embed_out

        def role(fqn: str) -> str:
            return "head" if _is_lm_head(fqn) or fqn in heads else "attention" if is_attention(fqn) else "body"

        targets = {fqn: m for fqn, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and by_role[role(fqn)] is not None}
        if opts.quantize == "8da4w":
            why = widths_error(opts.group_size, {f: m.in_features for f, m in targets.items()
                                                 if by_role[role(f)] is main})
            if why:
                raise ExportError(why)
        for name in ("body", "attention", "head"):
            if by_role[name] is not None:
                quantize_(model, by_role[name], lambda m, fqn, r=name: fqn in targets and role(fqn) == r)
    choice, decided = opts.embedding_quantize, {"embedding_option": opts.embedding_quantize}
    if choice == "auto":
        auto = _auto_embedding(model)
        choice = auto["choice"]
        decided["embedding_auto"] = {"quantized_to": choice, "fp32_table_share": auto["share"]}
    if choice is not None:
        emb = model.get_input_embeddings()
        if linear_scheme(emb.weight) != "fp32":
            raise ExportError(
                f"embedding_quantize={opts.embedding_quantize!r} but the embedding is already quantized "
                f"({linear_scheme(emb.weight)}); set embedding_quantize: null to export it as given"
            )
        if choice == "int4":
            why = embedding_width_error(opts.embedding_group_size, emb.embedding_dim)
            if why:
                raise ExportError(why)
        cfg = (
            IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
            if choice == "int8"
            else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(opts.embedding_group_size))
        )
        # padding_idx only changes gradients, but ExecuTorch's quant fusion matches embedding calls
        # with the default padding_idx only: with it set (SmolLM2: pad id 2), torchao's
        # dequantize_affine is left unfused and lowering fails ("Missing out variants").
        emb.padding_idx = None
        quantize_(model, cfg, lambda m, fqn: m is emb)
    return decided


_BITS = {(-8, 7): 4, (-128, 127): 8}


def exported_linear_schemes(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """The scheme each ``aten.linear`` of the exported graph really computes, by module name.

    Read from the graph, not the eager model: a weight that reaches the linear through
    ``torchao.dequantize_affine`` with int4 or int8 bounds is quantized, an input that went
    through ``quantize_affine`` -> ``dequantize_affine`` is the dynamic int8 activation. This is
    what the XNNPACK partitioner pattern-matches, so it is what the .pte runs.
    """
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
            continue  # RMSNorm's mean as a linear (export/executorch/delegable.py), not a layer
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
