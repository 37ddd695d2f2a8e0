"""Exact per-channel equalization: divide an activation channel by ``s``, multiply the weight
columns that read it by ``s``, and fold the division into the layer that produced it.

Used by SmoothQuant (move activation outliers into weights before W8A8) and by AWQ-style
scaling (protect salient input channels before 4-bit weights). The folds are exact in fp32,
so the model computes the same function and nothing is added at run time:

- ``qkv``:     input_layernorm.weight / s   ->  q/k/v_proj columns * s
- ``gate_up``: post_attention_layernorm.weight / s  ->  gate/up_proj columns * s
- ``down``:    up_proj rows (and bias) / s  ->  down_proj columns * s   (act(gate) * up is linear in up)
- ``o``:       v_proj rows / s  ->  o_proj columns * s, repeated over the query heads that share
               each KV head (attention output is a convex mix of V rows, so it is linear in V)

Only Llama-style blocks (HF LlamaDecoderLayer naming: Llama, Mistral, Qwen2, SmolLM) are
recognised; anything else raises with the structure expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

FoldKind = Literal["qkv", "gate_up", "down", "o"]
ALL_FOLDS: tuple[FoldKind, ...] = ("qkv", "gate_up", "down", "o")


@dataclass
class FoldGroup:
    """Linears reading one activation, and the module whose output that activation is."""

    kind: FoldKind
    source: str  # norm or linear whose output channels are divided by s
    linears: list[str]  # linears whose input columns are multiplied by s
    #: o only: query heads per KV head (o_proj columns repeat v_proj channels this many times)
    repeat: int = 1
    head_dim: int = 0

    @property
    def name(self) -> str:
        return f"{self.source}->{','.join(n.rsplit('.', 1)[-1] for n in self.linears)}"


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, mod in model.named_modules():
        if all(hasattr(mod, a) for a in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")):
            out.append((name, mod))
    return out


def fold_groups(model: nn.Module, kinds: tuple[FoldKind, ...] | list[FoldKind] = ALL_FOLDS) -> list[FoldGroup]:
    """The equalization groups of every decoder block, in model order."""
    bad = [k for k in kinds if k not in ALL_FOLDS]
    if bad:
        raise ValueError(f"unknown fold kind(s) {bad}; choose from {list(ALL_FOLDS)}")
    layers = _layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no Llama-style decoder blocks (input_layernorm, self_attn.q/k/v/o_proj, "
            "post_attention_layernorm, mlp.gate/up/down_proj); equalization folds only into those"
        )
    cfg = getattr(model, "config", None)
    groups: list[FoldGroup] = []
    for name, layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(isinstance(getattr(attn, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError(f"{name}.self_attn lacks nn.Linear q/k/v/o_proj (fused qkv is not supported)")
        if not all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{name}.mlp lacks nn.Linear gate/up/down_proj (fused gate_up is not supported)")
        a, m = f"{name}.self_attn", f"{name}.mlp"
        if "qkv" in kinds:
            groups.append(FoldGroup("qkv", f"{name}.input_layernorm", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]))
        if "o" in kinds:
            n_heads = getattr(cfg, "num_attention_heads", None)
            n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
            if not n_heads:
                raise ValueError("the 'o' fold needs model.config.num_attention_heads")
            head_dim = getattr(cfg, "head_dim", None) or attn.q_proj.out_features // n_heads
            groups.append(FoldGroup("o", f"{a}.v_proj", [f"{a}.o_proj"], repeat=n_heads // n_kv, head_dim=head_dim))
        if "gate_up" in kinds:
            groups.append(FoldGroup("gate_up", f"{name}.post_attention_layernorm", [f"{m}.gate_proj", f"{m}.up_proj"]))
        if "down" in kinds:
            groups.append(FoldGroup("down", f"{m}.up_proj", [f"{m}.down_proj"]))
    return groups


def channels(model: nn.Module, g: FoldGroup) -> int:
    """Number of per-channel scales the group takes (the source's output channels)."""
    src = model.get_submodule(g.source)
    return src.out_features if isinstance(src, nn.Linear) else src.weight.numel()


@torch.no_grad()
def apply_fold(model: nn.Module, g: FoldGroup, s: torch.Tensor) -> None:
    """Divide the source's output channels by ``s`` and multiply the readers' columns by ``s``."""
    s = s.detach().float().flatten()
    if s.numel() != channels(model, g):
        raise ValueError(f"{g.name}: {s.numel()} scales for {channels(model, g)} channels")
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"{g.name}: scales must be finite and positive")
    src = model.get_submodule(g.source)
    if isinstance(src, nn.Linear):  # up_proj or v_proj: scale output rows
        src.weight.div_(s.view(-1, 1).to(src.weight.dtype))
        if src.bias is not None:
            src.bias.div_(s.to(src.bias.dtype))
    else:  # RMSNorm / LayerNorm: weight (and bias) per channel
        src.weight.div_(s.to(src.weight.dtype))
        if getattr(src, "bias", None) is not None:
            src.bias.div_(s.to(src.bias.dtype))
    cols = expand(g, s)
    for name in g.linears:
        lin = model.get_submodule(name)
        lin.weight.mul_(cols.view(1, -1).to(lin.weight.dtype))


def expand(g: FoldGroup, s: torch.Tensor) -> torch.Tensor:
    """Scales as the readers' input columns see them (o_proj repeats each KV head's scales)."""
    if g.kind != "o" or g.repeat == 1:
        return s
    per_head = s.view(-1, g.head_dim)  # [n_kv, head_dim]
    return per_head.repeat_interleave(g.repeat, dim=0).flatten()  # query head h reads kv head h // repeat


def reduce(g: FoldGroup, per_column: torch.Tensor) -> torch.Tensor:
    """Collapse a per-input-column statistic of the readers back onto the source's channels."""
    if g.kind != "o" or g.repeat == 1:
        return per_column
    return per_column.view(-1, g.repeat, g.head_dim).amax(dim=1).flatten()


@dataclass
class ActStats:
    """Per-input-channel statistics of the activation each group's readers see."""

    absmax: torch.Tensor
    absmean_sum: torch.Tensor
    tokens: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)

    @property
    def absmean(self) -> torch.Tensor:
        return self.absmean_sum / max(self.tokens, 1)


@torch.no_grad()
def collect_stats(
    model: nn.Module, groups: list[FoldGroup], windows: list[torch.Tensor], keep_tokens: int = 0
) -> dict[str, ActStats]:
    """Run the calibration windows and record what the first reader of each group receives.

    ``keep_tokens`` > 0 also keeps that many input rows per group (spread over the windows)
    for scale searches that measure the layer's output error.
    """
    if not windows:
        raise ValueError("equalization needs calibration windows (ctx.calibration is empty)")
    stats: dict[str, ActStats] = {}
    per_window = -(-keep_tokens // len(windows)) if keep_tokens else 0
    handles = []

    def hook(key: str):
        def fn(_mod, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            st = stats.get(key)
            if st is None:
                st = stats[key] = ActStats(torch.zeros(x.shape[1]), torch.zeros(x.shape[1]))
            st.absmax = torch.maximum(st.absmax, x.abs().amax(0))
            st.absmean_sum += x.abs().sum(0)
            st.tokens += x.shape[0]
            if per_window:
                idx = torch.linspace(0, x.shape[0] - 1, min(per_window, x.shape[0])).long()
                st.samples.append(x[idx].clone())

        return fn

    for g in groups:
        handles.append(model.get_submodule(g.linears[0]).register_forward_pre_hook(hook(g.name)))
    try:
        for w in windows:
            model(w.view(1, -1))
    finally:
        for h in handles:
            h.remove()
    return stats
