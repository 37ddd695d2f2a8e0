"""What ``ptq_int8`` will quantize, decided and checked before the model is touched.

Why a module of its own: the QAT stage and ``bench/compress.py`` plan with the same rules
(selection patterns, layers already quantized, GPT-2 Conv1D projections, group widths, the
embedding options), and the size/decode budgets promote layers within that plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from optimize.stage_api import StageContext
from optimize.stages._select import SHORTHANDS, is_tied, module_name, select_modules, unmatched_patterns
from targets.group_size import embedding_width_error, widths_error

if TYPE_CHECKING:
    from optimize.stages.ptq_int8 import Ptq8Config

DEFAULT_GROUP_SIZE = 32
DEFAULT_EMBEDDING_GROUP_SIZE = 32


def is_quantized(weight: torch.Tensor) -> bool:
    from torchao.utils import TorchAOBaseTensor

    return isinstance(weight, TorchAOBaseTensor)


def conv1d_names(model: nn.Module) -> list[str]:
    """GPT-2-style ``transformers.pytorch_utils.Conv1D`` projections (not nn.Linear)."""
    return [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D" and hasattr(m, "nf")]


def untie_config(model: nn.Module) -> None:
    """Stop transformers from re-tying lm_head to the embedding (which would undo the stage)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    configs = [cfg]
    if hasattr(cfg, "get_text_config"):
        configs.append(cfg.get_text_config())
    for c in configs:
        if getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False


def plan(model: nn.Module, cfg: Ptq8Config) -> dict:
    """Decide which layers to quantize and check every constraint before touching the model."""
    user_patterns = [p for p in cfg.keep_high_precision + cfg.int8_modules if p not in SHORTHANDS] + list(cfg.modules or [])
    typos = unmatched_patterns(model, user_patterns)
    if typos:
        raise ValueError(
            f"ptq_int8: pattern(s) {typos} match no module of {type(model).__name__}; names look like "
            f"{[n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:3]}"
        )
    selected, kept = select_modules(model, nn.Linear, include=cfg.modules, exclude=cfg.keep_high_precision)
    mods = dict(model.named_modules())
    already = [n for n in selected if is_quantized(mods[n].weight)]
    if already:
        raise ValueError(f"ptq_int8: {len(already)} layer(s) are already quantized (e.g. {already[0]}); "
                         "a model goes through one quantization stage")
    conv1d = conv1d_names(model)
    if conv1d and cfg.modules is None:
        raise ValueError(
            f"ptq_int8: {type(model).__name__} uses transformers Conv1D (GPT-2 family) for {len(conv1d)} "
            f"projections (e.g. {conv1d[0]}); torchao quantizes nn.Linear only, so they would stay fp32. "
            "Set `modules` to quantize the nn.Linear layers deliberately, or use a Llama-family model."
        )
    if not selected:
        raise ValueError(
            "ptq_int8: no nn.Linear layer is left to quantize after `modules` and `keep_high_precision`"
        )
    int8: list[str] = []
    if cfg.int8_modules:
        int8, _ = select_modules(model, nn.Linear, include=cfg.int8_modules)
        clash = [n for n in int8 if n in kept]
        if clash:
            raise ValueError(f"ptq_int8: {clash[:3]} match both int8_modules and keep_high_precision; drop one")
        int8 = [n for n in selected if n in set(int8)]
    gs = cfg.effective_group_size
    if gs is not None:
        why = widths_error(gs, {n: mods[n].in_features for n in selected if n not in set(int8)})
        if why:
            raise ValueError(f"ptq_int8: {why}")
    emb_name = None
    if cfg.quantize_embedding == "tied":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not is_tied(model.get_input_embeddings(), head) or module_name(model, head) not in set(selected):
            raise ValueError("ptq_int8: quantize_embedding: tied needs a tied lm_head that this stage quantizes "
                             "(tie_word_embeddings and lm_head not kept in high precision)")
    elif cfg.quantize_embedding:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if not isinstance(emb, nn.Embedding):
            raise ValueError("ptq_int8: quantize_embedding needs a model whose get_input_embeddings() is nn.Embedding")
        if is_quantized(emb.weight):
            raise ValueError("ptq_int8: the input embedding is already quantized")
        egs = cfg.embedding_group_size or DEFAULT_EMBEDDING_GROUP_SIZE
        why = embedding_width_error(egs, emb.embedding_dim) if cfg.quantize_embedding == "int4" else None
        if why:
            raise ValueError(f"ptq_int8: {why}")
        emb_name = module_name(model, emb)
    return {"selected": selected, "kept": kept, "int8": int8, "conv1d_skipped": conv1d, "embedding": emb_name}


def budget_plan(model: nn.Module, cfg: Ptq8Config, ctx: StageContext, p: dict) -> dict:
    """Promote the most sensitive groups of ``p['selected']`` (to int8 or fp32) within the budgets."""
    from optimize.quant.mixed import budget_keep

    if not ctx.calibration:
        raise ValueError("ptq_int8: size_budget_mb / max_decode_slowdown_pct need calibration text to score sensitivity")
    algorithm = "hqq" if cfg.weight_qparams == "hqq_scale_only" else "rtn"
    plan, scored = budget_keep(model, p["selected"], ctx.calibration[: cfg.budget_windows or 2], cfg.scheme,
                               cfg.effective_group_size, cfg.size_budget_mb, cfg.budget_candidates, algorithm,
                               promote_to=cfg.promote_to, decode_budget_pct=cfg.max_decode_slowdown_pct,
                               int8_fixed=set(p["int8"]))
    keep = set(plan.kept)
    if cfg.promote_to == "8da8w":
        p["int8"] = [n for n in p["selected"] if n in keep or n in set(p["int8"])]
    else:
        p["selected"] = [n for n in p["selected"] if n not in keep]
        p["int8"] = [n for n in p["int8"] if n not in keep]
        p["kept"] = sorted(set(p["kept"]) | keep)
    if not p["selected"]:
        raise ValueError("ptq_int8: the size budget keeps every layer fp32; nothing is left to quantize")
    return {**plan.as_details(), "sensitivity_top": scored[:12]}
