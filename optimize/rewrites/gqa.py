"""Multi-head (or many-KV-head) attention -> grouped-query attention by pooling KV heads
(Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from
Multi-Head Checkpoints").

HF Llama-family attention maps query head ``i`` to KV head ``i // (H / H_kv)``, so going
from ``H_kv`` to ``G`` KV heads merges runs of ``r = H_kv / G`` consecutive KV heads; each
new head is initialised from its run: the mean (the paper's choice), the first head, or
random (the paper's ablations). The model stays the same HF class with a smaller
``num_key_value_heads``, so it saves, reloads and exports like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from train.model_parts import decoder_blocks

#: architectures whose attention has separate q/k/v/o projections and reads
#: ``num_key_value_groups`` from the module (checked against transformers 5.23)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class GQAError(ValueError):
    """The GQA rewrite cannot apply; the message says why and what would."""


@dataclass
class KVLayout:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    bytes_per_elem: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V cache bytes per token across all layers at the weights' dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_elem


def _attentions(model: nn.Module) -> list[nn.Module]:
    """Each decoder block's attention module (Llama-family: ``self_attn``)."""
    return [attn for _, block in decoder_blocks(model)
            if (attn := getattr(block, "self_attn", None)) is not None
            and all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj"))]


def config_problem(config: Any, num_key_value_heads: int) -> str | None:
    """Why a model with this transformers ``config`` cannot go to ``num_key_value_heads`` KV heads, or None."""
    mt = getattr(config, "model_type", "?")
    if mt not in SUPPORTED:
        return (
            f"architecture {mt!r} is not supported by the gqa stage; supported: "
            f"{', '.join(SUPPORTED)} (Llama-family attention with separate k_proj/v_proj)"
        )
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    valid = valid_kv_heads(kv)
    if num_key_value_heads not in valid:
        return (
            f"num_key_value_heads={num_key_value_heads} must divide the model's current {kv} KV heads; "
            f"valid values: {', '.join(map(str, valid))}"
        )
    return None


def kv_layout(model: nn.Module) -> KVLayout:
    """Check the architecture and read its attention layout, or raise GQAError."""
    cfg = model.config
    mt = getattr(cfg, "model_type", type(model).__name__)
    if mt not in SUPPORTED:
        raise GQAError(
            f"architecture {mt!r} ({type(model).__name__}) is not supported by the gqa stage; supported: "
            f"{', '.join(SUPPORTED)} (Llama-family attention with separate k_proj/v_proj)"
        )
    attns = _attentions(model)
    if not attns or not all(isinstance(a.k_proj, nn.Linear) and isinstance(a.v_proj, nn.Linear) for a in attns):
        raise GQAError(f"{mt}: no attention modules with nn.Linear k_proj/v_proj found")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = attns[0].k_proj.out_features // kv
    return KVLayout(len(attns), heads, kv, head_dim, attns[0].k_proj.weight.element_size())


def valid_kv_heads(kv_heads: int) -> list[int]:
    return [g for g in range(1, kv_heads + 1) if kv_heads % g == 0]


def _pool(t: torch.Tensor, kv: int, groups: int, init: str, gen: torch.Generator | None) -> torch.Tensor:
    """Pool the leading ``kv*head_dim`` rows of a K/V weight (or bias) into ``groups`` heads."""
    r = kv // groups
    x = t.detach().double().reshape(groups, r, -1, *t.shape[1:])  # [G, r, head_dim, (in)]
    if init == "mean":
        out = x.mean(dim=1)
    elif init == "first":
        out = x[:, 0]
    elif init == "random":
        if t.dim() == 1:  # biases start at zero
            out = torch.zeros_like(x[:, 0])
        else:
            std = float(t.detach().double().std())
            out = torch.randn(x[:, 0].shape, generator=gen, dtype=torch.float64) * std
    else:
        raise GQAError(f"unknown init {init!r}; choose mean, first or random")
    return out.reshape(-1, *t.shape[1:]).to(t.dtype)


def _shrink(lin: nn.Linear, kv: int, groups: int, init: str, gen) -> nn.Linear:
    w = _pool(lin.weight, kv, groups, init, gen)
    new = nn.Linear(lin.in_features, w.shape[0], bias=lin.bias is not None, dtype=lin.weight.dtype,
                    device=lin.weight.device)
    with torch.no_grad():
        new.weight.copy_(w)
        if lin.bias is not None:
            new.bias.copy_(_pool(lin.bias, kv, groups, init, gen))
    return new


def convert_to_gqa(
    model: nn.Module, num_key_value_heads: int, init: str = "mean", seed: int = 0
) -> tuple[KVLayout, KVLayout]:
    """Rewrite ``model`` in place to ``num_key_value_heads`` KV heads; returns (before, after) layouts."""
    before = kv_layout(model)
    why = config_problem(model.config, num_key_value_heads)
    if why:
        raise GQAError(why)
    if num_key_value_heads == before.kv_heads:
        return before, before
    gen = torch.Generator().manual_seed(seed)
    for attn in _attentions(model):
        attn.k_proj = _shrink(attn.k_proj, before.kv_heads, num_key_value_heads, init, gen)
        attn.v_proj = _shrink(attn.v_proj, before.kv_heads, num_key_value_heads, init, gen)
        attn.num_key_value_groups = before.heads // num_key_value_heads
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = num_key_value_heads
    model.config.num_key_value_heads = num_key_value_heads
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    text_cfg.num_key_value_heads = num_key_value_heads
    return before, kv_layout(model)
