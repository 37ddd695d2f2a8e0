"""Post-training int8 quantization with torchao: ``8da8w`` and ``8da4w`` for ExecuTorch/XNNPACK.

Both schemes quantize activations dynamically (per token, asymmetric int8, computed at run
time) and weights statically (symmetric, ``8da8w``: int8 per output channel; ``8da4w``: int4
in groups along the input dimension). Nothing depends on data, so the stage needs no
calibration text. These are the torchao layouts (``IntxUnpackedToInt8Tensor``) that
ExecuTorch's XNNPACK partitioner recognises after ``torch.export``; int8 *weight-only* Linear
is deliberately not offered (it lowers to wrong logits on XNNPACK, see the target profile).

Why ``keep_high_precision`` defaults to ``["lm_head"]``: on SmolLM2-135M (tied embeddings)
the output projection is the most sensitive matmul, and keeping it fp32 costs no extra
bytes because it shares its weight with the fp32 embedding table; quantizing it un-ties
the pair and *adds* an int8/int4 copy. The price is decode bandwidth on a device (the fp32
head is read for every token); set ``keep_high_precision: []`` when that matters more. See
bench/ptq.py for the measured figures. Reference perplexity (4096 pydoc targets), fp32 14.71:
8da8w with lm_head fp32 14.88 (+1.2%), all int8 14.99 (+1.9%, bench/ptq.py; the shared notes
said 15.1): the default leaves margin under a 2% gate and is smaller. hqq_scale_only
scales made 8da8w worse (15.00) but 8da4w g32 (lm_head fp32) better (21.20 -> 20.74).

``quantize_embedding`` (torchao weight-only ``IntxWeightOnlyConfig`` on the ``nn.Embedding``)
runs in eager and exports, but is not an XNNPACK op: ExecuTorch lowers it only with
``to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))``, which fuses it
into ``quantized_decomposed::embedding_byte``/``embedding_4bit``, and the ``.pte`` then loads
only after ``import executorch.kernels.quantized`` (int8 checked on executorch 1.5.1 with a tiny
Llama; the int4 path was not run to a .pte).
"""

from __future__ import annotations

import torch
from torch import nn

from optimize.module_select import is_tied, module_name
from optimize.quant.mixed import budget_keep
from optimize.quant.source_grid import find_grid, offset_module, record, restore as restore_grid
from optimize.stage_api import StageContext, register_stage
from optimize.stages.ptq_config import Ptq8Config
from optimize.stages.ptq_gptq import install_integers, quantize_gptq
from optimize.stages.ptq_plan import LayerPlan, untie_config
from targets.moe import expert_linears, routers, unfuse_experts

#: Ptq8Config is defined in ptq_config (read by the GPTQ glue and QAT too) and named here with its stage
__all__ = ["Ptq8Config", "budget_plan", "embedding_config", "linear_config", "ptq_int8", "restore"]


def linear_config(cfg: Ptq8Config):
    """The torchao config for the chosen scheme (the layout ExecuTorch's XNNPACK lowers)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    algo = dict(intx_choose_qparams_algorithm=cfg.weight_qparams)
    if cfg.scheme == "8da8w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0), **algo)
    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(cfg.effective_group_size), **algo
    )


def embedding_config(cfg: Ptq8Config):
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if cfg.quantize_embedding == "int8":
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(cfg.effective_embedding_group_size))


def budget_plan(model: nn.Module, cfg: Ptq8Config, ctx: StageContext, p: LayerPlan) -> dict:
    """Promote the most sensitive groups of ``p['selected']`` (to int8 or fp32) within the budgets;
    updates ``p`` in place and returns the report's details."""
    if not ctx.calibration:
        raise ValueError("ptq_int8: size_budget_mb / max_decode_slowdown_pct need calibration text to score sensitivity")
    algorithm = "hqq" if cfg.weight_qparams == "hqq_scale_only" else "rtn"
    kept_plan, scored = budget_keep(model, p["selected"], ctx.calibration[: cfg.budget_windows or 2], cfg.scheme,
                                    cfg.effective_group_size, cfg.size_budget_mb, cfg.budget_candidates, algorithm,
                                    promote_to=cfg.promote_to, decode_budget_pct=cfg.max_decode_slowdown_pct,
                                    int8_fixed=set(p["int8"]))
    keep = set(kept_plan.kept)
    if cfg.promote_to == "8da8w":
        p["int8"] = [n for n in p["selected"] if n in keep or n in set(p["int8"])]
    else:
        p["selected"] = [n for n in p["selected"] if n not in keep]
        p["int8"] = [n for n in p["int8"] if n not in keep]
        p["kept"] = sorted(set(p["kept"]) | keep)
    if not p["selected"]:
        raise ValueError("ptq_int8: the size budget keeps every layer fp32; nothing is left to quantize")
    return {**kept_plan.as_details(), "sensitivity_top": scored[:12]}


def source_grids(model: nn.Module, names: list[str], group_size: int) -> dict:
    """The Linears among ``names`` whose weights lie on a 4-bit grid of ``group_size`` columns;
    refuses a ``source_grid`` stage where none does (the source was no 4-bit GGUF). The output
    projection is never among them: it may share its table with the embedding, and exporters read
    its weight as a Linear's; it goes through the stage's ``algorithm``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = module_name(model, head) if head is not None else None
    grids = {}
    for name in [n for n in names if n != head_name]:
        split = find_grid(model.get_submodule(name).weight, group_size)
        if split is not None:
            grids[name] = split
    if names and not grids:
        raise ValueError(f"ptq_int8: source_grid: none of the {len(names)} int4 Linears has weights on a 4-bit grid of "
                         f"{group_size} columns (the model was not converted from a GGUF Q4_0/Q4_1/Q4_K file); "
                         "drop source_grid")
    return grids


def install_grids(model: nn.Module, grids: dict, cfg: Ptq8Config) -> dict:
    """Install each grid as symmetric int4 with the grid's step and, where the grid is not centred
    on zero, an offset path (:class:`~optimize.quant.source_grid.GroupOffsetLinear`). The details
    carry how far the split is from the weights it replaces (``max_relative_error``; the installer
    refuses integers that do not survive torchao's layout)."""
    from torchao.quantization import quantize_

    g = cfg.effective_group_size
    worst = 0.0
    install = lambda m, q, s: install_integers(m, q, s, 4, source="source grid")  # noqa: E731
    for name, split in grids.items():
        lin = model.get_submodule(name)
        before = lin.weight.detach().float()
        worst = max(worst, float((split.dequantized() - before).abs().max() / before.abs().max().clamp_min(1e-30)))
        if split.offset is None:
            install(lin, split.q, split.scale)
        else:
            model.set_submodule(name, offset_module(lin, split, install), strict=True)
    offsets = [n for n, s in grids.items() if s.offset is not None]
    precision = cfg.source_grid_offset or "fp32"
    if offsets and precision == "int8":
        sel = {f"{n}.offset" for n in offsets}
        quantize_(model, linear_config(cfg.model_copy(update={"scheme": "8da8w", "group_size": None})),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in sel)
    if offsets:
        record(model, offsets, g)
    return {"layers": len(grids), "with_offset_path": len(offsets), "offset_precision": precision,
            "max_relative_error": worst}


def restore(model: nn.Module, cfg: Ptq8Config) -> None:
    """A checkpoint's skeleton rebuilt as the stage left the model: experts unfused, grids recorded."""
    unfuse_experts(model)
    restore_grid(model)


@register_stage("ptq_int8", Ptq8Config, restore=restore)
def ptq_int8(model: nn.Module, cfg: Ptq8Config, ctx: StageContext) -> nn.Module:
    """Quantize nn.Linear layers with torchao: 8da8w (int8 per-channel) or 8da4w (int4 groups), round-to-nearest or GPTQ, mixed precision by hand or by budget."""
    from torchao.quantization import quantize_

    # a mixture of experts: one Linear per expert projection (the same function), so torchao and
    # GPTQ see every expert; the router (no nn.Linear) stays fp32 and routes as before
    unfused = unfuse_experts(model)
    p = cfg.layer_plan(model)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    was_tied = is_tied(in_emb, out_emb)

    budget = None
    if cfg.size_budget_mb is not None or cfg.max_decode_slowdown_pct is not None:
        budget = budget_plan(model, cfg, ctx, p)
    eight = [n for n in p["selected"] if n in set(p["int8"])] if cfg.scheme == "8da4w" else []
    four = [n for n in p["selected"] if n not in set(eight)]
    grids = source_grids(model, four, cfg.effective_group_size) if cfg.source_grid else {}
    four = [n for n in four if n not in grids]
    gptq = None
    if cfg.algorithm == "gptq" and (four or eight):  # first, on the model as it came: the grid layers are still exact
        gptq = quantize_gptq(model, cfg, ctx, four, eight)
    elif four or eight:
        sel4 = set(four)
        quantize_(model, linear_config(cfg), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in sel4)
        if eight:
            sel8 = set(eight)
            quantize_(model, linear_config(cfg.model_copy(update={"scheme": "8da8w", "group_size": None})),
                      filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in sel8)
    grid_details = install_grids(model, grids, cfg) if cfg.source_grid else None
    if p["embedding"] is not None:
        emb_fqn = p["embedding"]
        quantize_(model, embedding_config(cfg), filter_fn=lambda m, fqn: fqn == emb_fqn)

    if cfg.quantize_embedding == "tied":  # the embedding looks up the lm_head's quantized rows
        if type(out_emb.weight) in (torch.Tensor, nn.Parameter):
            raise ValueError("ptq_int8: quantize_embedding: tied, but the lm_head was left fp32 (by the size budget?)")
        in_emb.weight = out_emb.weight
    untied = was_tied and not is_tied(in_emb, out_emb)
    if untied:
        untie_config(model)
    ctx.details.update(
        {
            "scheme": cfg.scheme,
            "group_size": cfg.effective_group_size,
            "weight_bits": 8 if cfg.scheme == "8da8w" else 4,
            "algorithm": cfg.algorithm,
            "weight_qparams": cfg.weight_qparams,
            "activations": "int8 dynamic per-token (no calibration)",
            "linear_quantized": len(p["selected"]),
            "linear_kept": len(p["kept"]),
            "kept_modules": p["kept"],
            "int8_modules": eight,
            "precision_mix": {"fp32": len(p["kept"]), "8da8w": len(eight) if cfg.scheme == "8da4w" else len(four),
                              "8da4w": len(four) + len(grids) if cfg.scheme == "8da4w" else 0},
            "embedding_quantized": cfg.quantize_embedding,
            "untied_embeddings": untied,
        }
    )
    if gptq is not None:
        ctx.details["gptq"] = gptq
    if grid_details is not None:
        ctx.details["source_grid"] = grid_details
    if budget is not None:
        ctx.details["mixed_precision"] = budget
    if p["conv1d_skipped"]:
        ctx.details["conv1d_kept_fp32"] = p["conv1d_skipped"]
    if unfused:
        experts = set(expert_linears(model))
        ctx.details["experts"] = {"blocks_unfused": len(unfused), "expert_linears": len(experts),
                                  "expert_linears_quantized": len(experts & set(p["selected"])),
                                  "routers_kept_fp32": routers(model)}
    ctx.log(
        f"ptq_int8 {cfg.scheme} ({cfg.algorithm}): quantized {len(p['selected'])} Linear layers"
        + (f" ({len(eight)} at 8da8w)" if eight else "")
        + f", kept {len(p['kept'])} in fp32"
        + (f" ({', '.join(p['kept'][:4])}{'...' if len(p['kept']) > 4 else ''})" if p["kept"] else "")
        + (f"; embedding {cfg.quantize_embedding}" if cfg.quantize_embedding else "")
        + (f"; {len(grids)} kept their source's 4-bit grid exactly" if grids else "")
    )
    return model
