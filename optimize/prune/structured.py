"""Structured pruning surgery: a genuinely smaller dense model, not a masked one.

Each function slices the state dict and rebuilds the model from its updated transformers
config (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, with ``head_dim`` kept explicit so it does not follow the head count).
Rebuilding, rather than editing modules in place, is what makes the result exactly what
``from_pretrained`` would build from the saved config: per-block indices (KV-cache slots,
``layer_types``), per-module head counts and the rotary tables all come from the new config.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Sequence

import torch
from torch import nn

from optimize.prune.arch import FAMILIES, PER_LAYER_LISTS, decoder_layers, hidden_norms, shape

_LAYER_KEY = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


class PruneError(ValueError):
    """The model cannot be pruned as asked; the message says why and what would work."""


def check_plain(model: nn.Module) -> None:
    """Structured pruning rebuilds the model from its config, so it must run on the plain HF
    module tree: before quantization or module-swapping rewrites."""
    for name, p in model.named_parameters():
        if type(p.data) is not torch.Tensor:
            raise PruneError(f"prune: {name} is a {type(p.data).__name__}, not a plain tensor; prune before "
                             "quantizing (put the prune stage ahead of ptq_int8/qat/awq)")


def rebuild(model: nn.Module, config: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """A fresh model of the same class for ``config``, holding ``state`` (no random init)."""
    from transformers.initialization import no_init_weights

    ref = next(model.parameters())
    with no_init_weights():
        new = type(model)(config)
    new.to(device=ref.device, dtype=ref.dtype)
    missing, unexpected = new.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise PruneError(
            f"prune: the pruned weights do not fit a freshly built {type(model).__name__} (missing "
            f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}); prune must run on the "
            "model as transformers builds it, before stages that swap modules (rmsnorm, quantization)"
        )
    if tied:
        new.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = copy.deepcopy(model.generation_config)
    new.train(model.training)
    return new


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def drop_blocks(model: nn.Module, keep: Sequence[int]) -> nn.Module:
    """Keep only decoder blocks ``keep`` (sorted, renumbered 0..n-1)."""
    check_plain(model)
    n = len(decoder_layers(model))
    keep = sorted(set(int(i) for i in keep))
    if not keep or keep[0] < 0 or keep[-1] >= n:
        raise PruneError(f"prune: blocks to keep {keep} must be a non-empty subset of 0..{n - 1}")
    new_index = {old: new for new, old in enumerate(keep)}
    state = {}
    for key, value in _state(model).items():
        m = _LAYER_KEY.match(key)
        if m is None:
            state[key] = value
        elif int(m.group(2)) in new_index:
            state[f"{m.group(1)}{new_index[int(m.group(2))]}{m.group(3)}"] = value
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(keep)
    for attr in PER_LAYER_LISTS:
        values = getattr(config, attr, None)
        if isinstance(values, (list, tuple)) and len(values) == n:
            setattr(config, attr, [values[i] for i in keep])
    return rebuild(model, config, state)


def _rows(heads: Sequence[int], head_dim: int, offset: int = 0) -> torch.Tensor:
    return torch.cat([torch.arange(offset + h * head_dim, offset + (h + 1) * head_dim) for h in heads])


def slice_width(
    model: nn.Module,
    kept_heads: Sequence[Sequence[int]],
    kept_kv: Sequence[Sequence[int]],
    kept_channels: Sequence[torch.Tensor],
    kept_hidden: torch.Tensor | None = None,
) -> nn.Module:
    """Keep, in every block ``i``, the query heads ``kept_heads[i]``, the KV heads ``kept_kv[i]``
    and the MLP channels ``kept_channels[i]`` (same counts in every block: one config), and, if
    given, the residual-stream (embedding) channels ``kept_hidden`` everywhere."""
    check_plain(model)
    fam = FAMILIES[model.config.model_type]
    s = shape(model.config)
    d, H, KV, I = s["head_dim"], s["heads"], s["kv_heads"], s["intermediate"]
    counts = {(len(h), len(k), int(c.numel())) for h, k, c in zip(kept_heads, kept_kv, kept_channels)}
    if len(counts) != 1:
        raise PruneError(f"prune: every block must keep the same head and channel counts, got {sorted(counts)}")
    (nh, nkv, ni), = counts
    if nh % nkv:
        raise PruneError(f"prune: {nh} query heads do not split evenly over {nkv} KV heads")
    state = _state(model)
    for i, (heads, kvs, ch) in enumerate(zip(kept_heads, kept_kv, kept_channels)):
        p = f"model.layers.{i}."
        q_rows, kv_rows = _rows(sorted(heads), d), _rows(sorted(kvs), d)
        ch = torch.sort(torch.as_tensor(ch, dtype=torch.long)).values
        if fam.fused_qkv:
            rows = torch.cat([q_rows, H * d + kv_rows, (H + KV) * d + kv_rows])
            state[p + "self_attn.qkv_proj.weight"] = state[p + "self_attn.qkv_proj.weight"][rows]
            if p + "self_attn.qkv_proj.bias" in state:
                state[p + "self_attn.qkv_proj.bias"] = state[p + "self_attn.qkv_proj.bias"][rows]
        else:
            for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                for kind in ("weight", "bias"):
                    key = f"{p}self_attn.{proj}.{kind}"
                    if key in state:
                        state[key] = state[key][rows]
        state[p + "self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"][:, q_rows]
        if fam.fused_gate_up:
            state[p + "mlp.gate_up_proj.weight"] = state[p + "mlp.gate_up_proj.weight"][torch.cat([ch, I + ch])]
        else:
            for proj in ("gate_proj", "up_proj"):
                for kind in ("weight", "bias"):
                    key = f"{p}mlp.{proj}.{kind}"
                    if key in state:
                        state[key] = state[key][ch]
        state[p + "mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"][:, ch]
    config = copy.deepcopy(model.config)
    if kept_hidden is not None:
        _slice_hidden(model, state, torch.sort(torch.as_tensor(kept_hidden, dtype=torch.long)).values, fam)
        config.hidden_size = int(len(kept_hidden))
    config.head_dim = d  # explicit: the default (hidden_size // heads) would change with the head count
    config.num_attention_heads = nh
    config.num_key_value_heads = nkv
    config.intermediate_size = ni
    return rebuild(model, config, {k: v.contiguous() for k, v in state.items()})


def _slice_hidden(model: nn.Module, state: dict[str, torch.Tensor], keep: torch.Tensor, fam) -> None:
    """Keep residual-stream channels ``keep``: embedding and head columns, every norm over the
    stream, the input columns of the projections that read it and the output rows of those
    that write it.

    RMSNorm divides by the root mean square over the channels: over ``H'`` channels instead of
    ``H`` the mean of squares is ``H / H'`` times larger when the removed channels are zero, so
    the norm weights are scaled by ``sqrt(H / H')``. That makes removing channels that carry
    nothing exact (up to ``eps``); for channels that did carry something it is the first-order
    correction, and distillation heals the rest."""
    hidden = model.config.hidden_size
    scale = (hidden / keep.numel()) ** 0.5
    for name in hidden_norms(model, hidden):
        for kind in ("weight", "bias"):
            if f"{name}.{kind}" in state:
                state[f"{name}.{kind}"] = state[f"{name}.{kind}"][keep] * (scale if kind == "weight" else 1.0)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in state:
            state[key] = state[key][:, keep]
    reads = ("qkv_proj",) if fam.fused_qkv else ("q_proj", "k_proj", "v_proj")
    reads += ("gate_up_proj",) if fam.fused_gate_up else ("gate_proj", "up_proj")
    for i in range(len(decoder_layers(model))):
        p = f"model.layers.{i}."
        for proj in reads:
            part = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "qkv_proj")) else "mlp"
            state[f"{p}{part}.{proj}.weight"] = state[f"{p}{part}.{proj}.weight"][:, keep]
        for key in ("self_attn.o_proj", "mlp.down_proj"):
            state[f"{p}{key}.weight"] = state[f"{p}{key}.weight"][keep]
            if f"{p}{key}.bias" in state:
                state[f"{p}{key}.bias"] = state[f"{p}{key}.bias"][keep]
