"""What ``ptq_int8`` will quantize, decided and checked before the model is touched.

Why a module of its own: the QAT stage and ``bench/compress.py`` plan with the same rules
(selection patterns, layers already quantized, GPT-2 Conv1D projections, group widths, the
embedding options), and validation runs them on a weightless model. The rules take plain
values, not the stage's config (:meth:`optimize.stages.ptq_config.Ptq8Config.layer_plan`
passes them), so this module sits below the config and imports no stage module.
"""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

from optimize.module_select import SHORTHANDS, is_tied, module_name, select_modules, unmatched_patterns
from targets.group_size import embedding_width_error, widths_error
from targets.moe import fused_expert_params


class LayerPlan(TypedDict):
    """The layers a quantization stage touches, by dotted module name."""

    selected: list[str]  #: Linears to quantize
    kept: list[str]  #: Linears left in high precision
    int8: list[str]  #: of ``selected``, those quantized 8da8w in an 8da4w stage
    conv1d_skipped: list[str]  #: GPT-2 Conv1D projections (never quantized)
    embedding: str | None  #: the input embedding to quantize weight-only, if any


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


def plan(
    model: nn.Module,
    *,
    keep_high_precision: list[str],
    modules: list[str] | None,
    int8_modules: list[str],
    group_size: int | None,
    quantize_embedding: str | None,
    embedding_group_size: int,
) -> LayerPlan:
    """Decide which layers to quantize and check every constraint before touching the model.

    ``group_size`` is the int4 group width (None: per-channel int8); ``embedding_group_size``
    applies to ``quantize_embedding: int4``. Raises ValueError (prefixed ``ptq_int8:``)."""
    user_patterns = [p for p in keep_high_precision + int8_modules if p not in SHORTHANDS] + list(modules or [])
    typos = unmatched_patterns(model, user_patterns)
    if typos:
        raise ValueError(
            f"ptq_int8: pattern(s) {typos} match no module of {type(model).__name__}; names look like "
            f"{[n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:3]}"
        )
    selected, kept = select_modules(model, nn.Linear, include=modules, exclude=keep_high_precision)
    mods = dict(model.named_modules())
    already = [n for n in selected if is_quantized(mods[n].weight)]
    if already:
        raise ValueError(f"ptq_int8: {len(already)} layer(s) are already quantized (e.g. {already[0]}); "
                         "a model goes through one quantization stage")
    fused = fused_expert_params(model)
    if fused:
        raise ValueError(
            f"ptq_int8: {type(model).__name__} keeps {len(fused)} expert weights fused in 3-D parameters (e.g. "
            f"{fused[0]}); torchao quantizes nn.Linear only, so they would stay fp32. Split them into per-expert "
            "Linears first (targets.moe.unfuse_experts; ptq_int8 does it itself)"
        )
    conv1d = conv1d_names(model)
    if conv1d and modules is None:
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
    if int8_modules:
        int8, _ = select_modules(model, nn.Linear, include=int8_modules)
        clash = [n for n in int8 if n in kept]
        if clash:
            raise ValueError(f"ptq_int8: {clash[:3]} match both int8_modules and keep_high_precision; drop one")
        int8 = [n for n in selected if n in set(int8)]
    if group_size is not None:
        why = widths_error(group_size, {n: mods[n].in_features for n in selected if n not in set(int8)})
        if why:
            raise ValueError(f"ptq_int8: {why}")
    emb_name = None
    if quantize_embedding == "tied":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not is_tied(model.get_input_embeddings(), head) or module_name(model, head) not in set(selected):
            raise ValueError("ptq_int8: quantize_embedding: tied needs a tied lm_head that this stage quantizes "
                             "(tie_word_embeddings and lm_head not kept in high precision)")
    elif quantize_embedding:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if not isinstance(emb, nn.Embedding):
            raise ValueError("ptq_int8: quantize_embedding needs a model whose get_input_embeddings() is nn.Embedding")
        if is_quantized(emb.weight):
            raise ValueError("ptq_int8: the input embedding is already quantized")
        why = embedding_width_error(embedding_group_size, emb.embedding_dim) if quantize_embedding == "int4" else None
        if why:
            raise ValueError(f"ptq_int8: {why}")
        emb_name = module_name(model, emb)
    return {"selected": selected, "kept": kept, "int8": int8, "conv1d_skipped": conv1d, "embedding": emb_name}
