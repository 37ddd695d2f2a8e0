"""What the fused ONNX Runtime graph gets for each Linear and the embedding, read from the
eager model, and the Hugging Face folder the model builder reads.

Eager-quantized Linears (torchao ``IntxUnpackedToInt8Tensor``) keep exactly their integers;
the exporter's own ``quantize: dynamic_per_token`` gives the remaining fp32 ones per-channel
int8. A tied embedding whose weight *is* the quantized lm_head's shares its packed table.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from export.base import ExportError
from export.group_offset import GroupOffsetLinear
from export.onnxruntime.weights import BlockQuant, from_torchao, rtn_int8_rows

Kernel = Literal["nbits", "per_token"]


@dataclass
class LinearPlan:
    """How one HF Linear reaches the graph: its integers (None = the exporter's RTN int8 of
    the fp32 weight) and the kernel that runs them."""

    kernel: Kernel
    bq: BlockQuant | None
    accuracy_level: int = 4
    #: a kept source grid's per-group offsets ``r`` [out, in / group] (float32), added to the
    #: MatMul's output as ``sum over each group of x`` times ``r``; None for a plain Linear
    offset: torch.Tensor | None = None


@dataclass
class FusedPlan:
    linears: dict[str, LinearPlan] = field(default_factory=dict)
    #: the input embedding: None (fp32), its own integers, or "tied" (the lm_head's integers)
    embedding: BlockQuant | Literal["tied"] | None = None
    lm_head: str | None = None
    fuse_qkv: bool = True

    def schemes(self) -> dict[str, str]:
        """Scheme per planned Linear, for the manifest: e.g. ``int4 g32 nbits``."""
        out = {}
        for name, p in self.linears.items():
            bits = p.bq.bits if p.bq is not None else 8
            group = "channel" if p.bq is None or p.bq.group == p.bq.shape[1] else f"g{p.bq.group}"
            out[name] = f"int{bits} {group} {p.kernel}"
        return out


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The model's Linears by the name the builder's graph knows them by: a kept source grid's
    :class:`~export.group_offset.GroupOffsetLinear` is named as the Linear it replaced and stands
    for its int4 part (see :func:`_grid_parts`); its inner Linears are not listed."""
    wrapped = _wrappers(model)
    inner = {f"{n}.{part}" for n in wrapped for part in ("linear", "offset")}
    out = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in inner}
    return {**out, **{n: w.linear for n, w in wrapped.items()}}


def _wrappers(model: torch.nn.Module) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, GroupOffsetLinear)}


def _dense(weight: torch.Tensor) -> torch.Tensor:
    return (weight if type(weight) in (torch.Tensor, torch.nn.Parameter) else weight.dequantize()).detach().float()


def _grid_parts(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each offset path's per-group offsets ``r`` [out, groups] (int8 de-quantized) and its bias.
    The builder's graph sums the groups itself (ReduceSum), so the group-sum rows of the int4
    weight are not shipped."""
    return {n: (_dense(w.offset.weight), None if w.offset.bias is None else w.offset.bias.detach().float())
            for n, w in _wrappers(model).items()}


def _module_name(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def plan_model(model: torch.nn.Module, *, per_token_fp32: bool, quantize_lm_head: bool, quantize_embedding: bool,
               exclude_modules: list[str], int8_kernel: Kernel, accuracy_level: int) -> FusedPlan:
    """Which Linear gets which integers and kernel. Eager-quantized Linears keep exactly their
    integers; with ``per_token_fp32`` the fp32 ones (minus exclusions and, unless
    ``quantize_lm_head``, the lm_head) get the exporter's per-channel int8."""
    lin = _linears(model)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    plan = FusedPlan(lm_head=_module_name(model, out_emb))
    grids = _grid_parts(model)
    for name, mod in lin.items():
        try:
            bq = from_torchao(mod.weight)
        except ValueError as exc:
            raise ExportError(f"onnxruntime exporter: {name}: {exc}") from None
        if bq is not None:
            _check_dequantize(name, mod.weight, bq)
            if name in grids:
                bq = bq.rows(0, grids[name][0].shape[0])  # without the group-sum rows
            kernel: Kernel = "nbits" if bq.bits == 4 or int8_kernel == "nbits" or not _per_channel(bq) else "per_token"
            plan.linears[name] = LinearPlan(kernel, bq, accuracy_level, grids[name][0] if name in grids else None)
        elif name in grids:
            raise ExportError(f"onnxruntime exporter: {name}: an offset path around an unquantized Linear")
        elif per_token_fp32 and not any(fnmatch.fnmatchcase(name, p) for p in exclude_modules):
            if name == plan.lm_head and not quantize_lm_head:
                continue
            plan.linears[name] = LinearPlan(int8_kernel, None, accuracy_level)
    if in_emb is not None:
        try:
            ebq = from_torchao(in_emb.weight)
        except ValueError as exc:
            raise ExportError(f"onnxruntime exporter: input embedding: {exc}") from None
        head = plan.linears.get(plan.lm_head or "")
        if ebq is not None and out_emb is not None and in_emb.weight is out_emb.weight and head is not None:
            head.kernel = "nbits"  # one packed table for both: MatMulNBits and GatherBlockQuantized read it
            plan.embedding = "tied"
        elif ebq is not None:
            _check_dequantize("input embedding", in_emb.weight, ebq)
            plan.embedding = ebq
        elif quantize_embedding:
            plan.embedding = rtn_int8_rows(in_emb.weight.detach())
    plan.fuse_qkv = _qkv_fusable(lin, plan)
    return plan


def _per_channel(bq: BlockQuant) -> bool:
    return bq.bits == 8 and bq.group == bq.shape[1] and bq.zero is None


def _check_dequantize(name: str, weight: torch.Tensor, bq: BlockQuant) -> None:
    """What we ship must be what eager computes with: torchao's dequantize == ours, exactly."""
    if not torch.equal(weight.dequantize().to(torch.float32), bq.dequantize()):
        raise ExportError(f"onnxruntime exporter: {name}: torchao's dequantized weight differs from its integers x scales")


def _qkv_fusable(lin: dict[str, torch.nn.Linear], plan: FusedPlan) -> bool:
    """Pack Q, K and V into one MatMul only where all three get the same treatment."""
    for name in lin:
        if name.endswith(".q_proj"):
            trio = [name[: -len("q_proj")] + p for p in ("q_proj", "k_proj", "v_proj")]
            kinds = [_kind(plan.linears.get(t)) for t in trio]
            if len(set(kinds)) > 1:
                return False
    return True


def _kind(p: LinearPlan | None):
    if p is None:
        return None
    if p.bq is None:
        return (p.kernel, p.accuracy_level)
    return (p.kernel, p.accuracy_level, p.bq.bits, p.bq.group, p.bq.zero is None, p.offset is None)


# ---------------------------------------------------------------------------------- HF folder


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors with every torchao weight dequantized (what the builder reads)."""
    sd = {}
    for name, t in model.state_dict().items():
        bq = from_torchao(t) if isinstance(t, torch.Tensor) else None
        sd[name] = (bq.dequantize() if bq is not None else t.detach().to(torch.float32)).contiguous()
    for name, (r, bias) in _grid_parts(model).items():  # a kept source grid: the Linear it replaced, whole
        for key in [k for k in sd if k.startswith(f"{name}.linear.") or k.startswith(f"{name}.offset.")]:
            sd.pop(key)
        w = _dense(model.get_submodule(name).linear.weight)[: r.shape[0]]
        sd[f"{name}.weight"] = (w + r.repeat_interleave(w.shape[1] // r.shape[1], dim=1)).contiguous()
        if bias is not None:
            sd[f"{name}.bias"] = bias.contiguous()
    return sd


def write_hf_dir(model: torch.nn.Module, tokenizer, path: Path) -> None:
    """A Hugging Face folder the builder loads: config, dequantized fp32 weights, tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(model)
    config = model.config
    saved = getattr(config, "quantization_config", None)
    model.save_pretrained(str(path), state_dict=sd, safe_serialization=True)
    if saved is not None:
        config.quantization_config = saved
    tokenizer.save_pretrained(str(path))
