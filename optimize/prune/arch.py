"""Where each supported decoder family keeps the parts that pruning cuts.

Structured pruning edits tensors by name, so it must know each family's layout: separate
``q_proj``/``k_proj``/``v_proj`` or Phi-3's fused ``qkv_proj`` (rows ``[q | k | v]``),
separate ``gate_proj``/``up_proj`` or Phi-3's fused ``gate_up_proj`` (rows ``[gate | up]``).
Families are listed explicitly (and tested): a family that merely looks similar may hide a
tensor whose size depends on the head count (OLMo-2 normalises q/k over all heads at once),
and pruning it would silently break the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from train.model_parts import decoder_blocks


@dataclass(frozen=True)
class Family:
    fused_qkv: bool = False
    fused_gate_up: bool = False
    #: the config class refuses a head count that does not divide hidden_size, even with an
    #: explicit head_dim (transformers' ``validate_architecture``), so such counts cannot reload
    heads_divide_hidden: bool = False
    #: embedding channels can be pruned: not for Gemma, whose embeddings are scaled by
    #: sqrt(hidden_size) and tied to the head, so the scale could not be compensated
    hidden_prunable: bool = True


#: model_type -> layout; every family here keeps its blocks in ``model.model.layers``
FAMILIES: dict[str, Family] = {
    "llama": Family(heads_divide_hidden=True),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "phi3": Family(fused_qkv=True, fused_gate_up=True),
    "gemma": Family(hidden_prunable=False),
    "gemma2": Family(heads_divide_hidden=True, hidden_prunable=False),
    "gemma3_text": Family(heads_divide_hidden=True, hidden_prunable=False),
}

#: config attributes holding one entry per decoder block (sliced when blocks are dropped)
PER_LAYER_LISTS = ("layer_types",)


def supported() -> str:
    return ", ".join(FAMILIES)


def family_of(config: Any) -> Family | None:
    return FAMILIES.get(getattr(config, "model_type", None))


def family_problem(config: Any, what: str) -> str | None:
    """A sentence if ``what`` (a pruning method) cannot handle this config's architecture."""
    mt = getattr(config, "model_type", None)
    if mt not in FAMILIES:
        return (f"{what} pruning supports the decoder families {supported()}; this model is {mt!r} "
                f"({(getattr(config, 'architectures', None) or ['?'])[0]}). Unstructured and 2:4 pruning "
                "work on any model with nn.Linear layers")
    return None


def shape(config: Any) -> dict[str, int]:
    """The sizes structured pruning changes, with ``head_dim`` resolved as the model resolves it."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"layers": int(config.num_hidden_layers), "heads": heads, "kv_heads": kv, "head_dim": int(head_dim),
            "intermediate": int(config.intermediate_size), "hidden": int(config.hidden_size)}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks (:func:`train.model_parts.decoder_blocks`, the lookup every feature
    shares), which structured surgery also needs at ``model.layers.N`` in the state dict."""
    names = [n for n, _ in decoder_blocks(model)]
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not names or not isinstance(layers, nn.ModuleList) or names != [f"model.layers.{i}" for i in range(len(layers))]:
        raise ValueError(f"prune: {type(model).__name__} keeps no decoder blocks in model.model.layers; "
                         f"supported families: {supported()}")
    return layers


def hidden_norms(model: nn.Module, hidden: int) -> list[str]:
    """Names of the norms over the residual stream (every block's, and the final one); per-head
    q/k norms (Qwen3, Gemma-3) normalise ``head_dim`` channels and are left alone."""
    out = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in leaf.lower() and leaf not in ("q_norm", "k_norm") and w is not None and w.dim() == 1 \
                and w.numel() == hidden:
            out.append(name)
    return out
