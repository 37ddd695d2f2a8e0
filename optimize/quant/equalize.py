"""Exact per-channel equalization: divide an activation channel by ``s``, multiply the weight
columns that read it by ``s``, and fold the division into the layer that produced it.

Used by SmoothQuant (move activation outliers into weights before W8A8) and by AWQ-style
scaling (protect salient input channels before 4-bit weights). The folds are exact in fp32,
so the model computes the same function and nothing is added at run time:

- ``qkv``:     attention pre-norm weight / s  ->  q/k/v (or fused qkv) columns * s
- ``gate_up``: MLP pre-norm weight / s  ->  gate/up (or fused gate_up) columns * s
- ``down``:    up_proj rows (and bias) / s  ->  down_proj columns * s   (act(gate) * up is linear in up)
- ``o``:       v_proj rows / s  ->  o_proj columns * s, repeated over the query heads that share
               each KV head (attention output is a convex mix of V rows, so it is linear in V)

In a mixture of experts (its experts split into Linears by :mod:`targets.moe`) ``gate_up`` scales
the router's columns too, and ``down`` is one group per expert. Which norm is which, fused
projections and Gemma's ``x * (1 + w)`` norms are per architecture (:mod:`optimize.quant.fold_layouts`); others are refused. The stages check the
logits after folding (:mod:`optimize.rewrites.exactness`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from optimize.device import model_device
from optimize.quant.fold_layouts import FoldLayout, FoldRefused, layout_for, norm_offset
from targets.moe import UnfusedExperts
from train.model_parts import decoder_blocks

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
    #: linear sources only: the output rows ``[start, stop)`` that are the activation (fused projections)
    rows: tuple[int, int] | None = None
    #: readers whose columns take the scales too but stay unquantized, so the scale searches leave them
    #: out (a mixture of experts' router: it reads every token, the experts only those routed to them)
    fixed: list[str] = field(default_factory=list)

    @property
    def reader(self) -> str:
        """The module whose input is the activation, as every token sees it (statistics are hooked here)."""
        return (self.fixed or self.linears)[0]

    @property
    def name(self) -> str:
        src = self.source if self.rows is None else f"{self.source}[{self.rows[0]}:{self.rows[1]}]"
        return f"{src}->{','.join(n.rsplit('.', 1)[-1] for n in self.linears)}"


def _linear(model: nn.Module, name: str) -> nn.Linear:
    try:
        mod = model.get_submodule(name)
    except AttributeError:
        mod = None
    if not isinstance(mod, nn.Linear):
        raise FoldRefused(f"{name} is {type(mod).__name__ if mod is not None else 'missing'}, expected nn.Linear")
    return mod


def _module(model: nn.Module, name: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise FoldRefused(f"{name} is missing; the fold needs {what}") from None


def fold_groups(model: nn.Module, kinds: tuple[FoldKind, ...] | list[FoldKind] = ALL_FOLDS) -> list[FoldGroup]:
    """The equalization groups of every decoder block, in model order (FoldRefused if unsupported).

    Works on a weightless (meta-device) model too, so the stages' pre-flight checks run it."""
    bad = [k for k in kinds if k not in ALL_FOLDS]
    if bad:
        raise ValueError(f"unknown fold kind(s) {bad}; choose from {list(ALL_FOLDS)}")
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise FoldRefused(f"{type(model).__name__} has no transformers config; equalization folds need a known architecture")
    lay = layout_for(cfg)
    layers = decoder_blocks(model)
    if not layers:
        raise FoldRefused(f"{type(model).__name__} has no decoder blocks to fold into")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    groups: list[FoldGroup] = []
    for name, layer in layers:
        a, m = f"{name}.self_attn", f"{name}.mlp"
        attn = _module(model, a, "the block's attention module")
        n_heads = text.num_attention_heads
        n_kv = getattr(text, "num_key_value_heads", None) or n_heads
        head_dim = getattr(attn, "head_dim", None) or getattr(text, "head_dim", None) or text.hidden_size // n_heads
        if lay.fused_qkv:
            qkv = _linear(model, f"{a}.{lay.fused_qkv}")
            if qkv.out_features != (n_heads + 2 * n_kv) * head_dim:
                raise FoldRefused(f"{a}.{lay.fused_qkv} has {qkv.out_features} rows, not (q + k + v heads) * head_dim")
            readers = [f"{a}.{lay.fused_qkv}"]
            v_src, v_rows = readers[0], ((n_heads + n_kv) * head_dim, (n_heads + 2 * n_kv) * head_dim)
        else:
            readers = [f"{a}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
            for r in readers:
                _linear(model, r)
            v_src, v_rows = f"{a}.v_proj", None
        o = _linear(model, f"{a}.o_proj")
        mlp_readers, fixed, downs = _mlp_readers(model, m, lay)
        if "qkv" in kinds:
            _module(model, f"{name}.{lay.attn_norm}", "the norm feeding the attention projections")
            groups.append(FoldGroup("qkv", f"{name}.{lay.attn_norm}", readers))
        if "o" in kinds:
            if getattr(attn, "v_norm", None) is not None:
                raise FoldRefused(f"{a} normalises v (v_norm), so v_proj's rows cannot carry scales; drop the 'o' fold")
            if o.in_features != n_heads * head_dim or n_heads % n_kv:
                raise FoldRefused(f"{a}.o_proj reads {o.in_features} columns, not {n_heads} heads * {head_dim}")
            groups.append(FoldGroup("o", v_src, [f"{a}.o_proj"], repeat=n_heads // n_kv, head_dim=head_dim, rows=v_rows))
        if "gate_up" in kinds:
            _module(model, f"{name}.{lay.mlp_norm}", "the norm feeding the MLP")
            groups.append(FoldGroup("gate_up", f"{name}.{lay.mlp_norm}", mlp_readers, fixed=fixed))
        if "down" in kinds:
            for up_src, up_rows, down_name in downs:
                down = _linear(model, down_name)
                width = (up_rows[1] - up_rows[0]) if up_rows else _linear(model, up_src).out_features
                if down.in_features != width:
                    raise FoldRefused(f"{down_name} reads {down.in_features} columns but the up projection writes {width}")
                groups.append(FoldGroup("down", up_src, [down_name], rows=up_rows))
    return groups


def _mlp_readers(model: nn.Module, m: str, lay: FoldLayout) -> tuple[list[str], list[str], list[tuple[str, tuple | None, str]]]:
    """The MLP ``m``'s readers of its pre-norm (Linears, and the router of a mixture of experts),
    and each ``(up source, its rows, down projection)`` pair: one per expert in a mixture."""
    if lay.experts:
        experts = _module(model, f"{m}.{lay.experts}", "the mixture's experts")
        if not isinstance(experts, UnfusedExperts):
            raise FoldRefused(f"{m}.{lay.experts} keeps its experts fused in 3-D weights; the folds need one Linear "
                              "per expert projection (targets.moe.unfuse_experts)")
        router = _module(model, f"{m}.{lay.router}", "the router reading the MLP's input")
        w = getattr(router, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise FoldRefused(f"{m}.{lay.router} has no [experts, hidden] weight to carry the scales")
        prefixes = [f"{m}.{lay.experts}.{e}" for e in range(len(experts))]
        readers = [f"{p}.{proj}" for p in prefixes for proj in ("gate_proj", "up_proj")]
        for r in readers:
            _linear(model, r)
        return readers, [f"{m}.{lay.router}"], [(f"{p}.up_proj", None, f"{p}.down_proj") for p in prefixes]
    if lay.fused_gate_up:
        gu = _linear(model, f"{m}.{lay.fused_gate_up}")
        half = gu.out_features // 2
        return [f"{m}.{lay.fused_gate_up}"], [], [(f"{m}.{lay.fused_gate_up}", (half, 2 * half), f"{m}.down_proj")]
    readers = [f"{m}.gate_proj", f"{m}.up_proj"]
    for r in readers:
        _linear(model, r)
    return readers, [], [(f"{m}.up_proj", None, f"{m}.down_proj")]


def channels(model: nn.Module, g: FoldGroup) -> int:
    """Number of per-channel scales the group takes (the source's output channels)."""
    if g.rows is not None:
        return g.rows[1] - g.rows[0]
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
    if isinstance(src, nn.Linear):  # up_proj or v_proj (or their rows of a fused projection): scale output rows
        lo, hi = g.rows if g.rows is not None else (0, src.out_features)
        w = src.weight[lo:hi]
        w.copy_((w.double() / s.double().view(-1, 1)).to(w.dtype))
        if src.bias is not None:
            b = src.bias[lo:hi]
            b.copy_((b.double() / s.double()).to(b.dtype))
    else:  # RMSNorm / LayerNorm computing n(x) * (c + weight) [+ bias]: (c + w') = (c + w) / s
        c = norm_offset(src, g.source)
        src.weight.copy_(((c + src.weight.double()) / s.double() - c).to(src.weight.dtype))
        if getattr(src, "bias", None) is not None:
            src.bias.copy_((src.bias.double() / s.double()).to(src.bias.dtype))
    cols = expand(g, s).double()
    for name in g.linears + g.fixed:
        lin = model.get_submodule(name)
        lin.weight.copy_((lin.weight.double() * cols.view(1, -1)).to(lin.weight.dtype))


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
    """Run the calibration windows and record what each group's :attr:`~FoldGroup.reader` receives
    (a mixture's expert that no token was routed to has no entry: its folds keep ``s = 1``).

    ``keep_tokens`` > 0 also keeps that many input rows per group (spread over the windows)
    for scale searches that measure the layer's output error.
    """
    if not windows:
        raise ValueError("equalization needs calibration windows (ctx.calibration is empty)")
    stats: dict[str, ActStats] = {}
    per_window = -(-keep_tokens // len(windows)) if keep_tokens else 0
    handles = []
    device = model_device(model)

    def hook(key: str):
        def fn(_mod, args):
            x = args[0].detach()
            # a float64 calibration (optimize.quant.host_independent) keeps its precision in the
            # statistics: rounded to fp32 here, a last-bit difference between CPU paths would reach
            # the scales derived from them
            x = (x if x.dtype == torch.float64 else x.float()).reshape(-1, x.shape[-1])
            st = stats.get(key)
            if st is None:  # statistics stay where the activations are (the model's device)
                st = stats[key] = ActStats(x.new_zeros(x.shape[1]), x.new_zeros(x.shape[1], dtype=torch.float64))
            st.absmax = torch.maximum(st.absmax, x.abs().amax(0))
            st.absmean_sum += x.abs().double().sum(0)  # float64: the same sum on every CPU path
            st.tokens += x.shape[0]
            if per_window:
                # the rows picked on the CPU, so every device samples the same ones
                idx = torch.linspace(0, x.shape[0] - 1, min(per_window, x.shape[0])).long().to(x.device)
                st.samples.append(x[idx].float())

        return fn

    for g in groups:
        handles.append(model.get_submodule(g.reader).register_forward_pre_hook(hook(g.name)))
    try:
        for w in windows:
            model(w.view(1, -1).to(device))
    finally:
        for h in handles:
            h.remove()
    return stats
