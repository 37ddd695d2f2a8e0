"""Importance scores measured on calibration text (``ctx.calibration``, never the eval span).

- :func:`block_influence`: ShortGPT's Block Influence, ``1 - cos(input, output)`` of each
  decoder block averaged over tokens; a block that barely turns the residual stream is cheap
  to drop (Men et al. 2024).
- :func:`block_loss_increase`: the direct measure, how much the calibration loss rises when a
  block is skipped (one forward pass per block).
- :func:`width_importance`: Minitron's activation-based importance (Muralidharan et al.
  2024): per MLP channel the mean ``|activation|`` entering ``down_proj``, per attention head
  the mean L2 norm of its output entering ``o_proj``. A channel whose activation is zero on
  every token contributes nothing, so removing it leaves the logits unchanged.
- :func:`hidden_importance`: Minitron's embedding-channel importance, the mean ``|x|`` of each
  residual-stream channel at the output of every norm (each block's and the final), summed.
- :func:`input_norms`: per input channel of each Linear, ``||X_j||_2`` over calibration
  tokens: Wanda's activation factor (Sun et al. 2023).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from optimize.prune.arch import decoder_layers, hidden_norms, shape


def _windows(windows: Sequence[torch.Tensor], device: torch.device) -> Iterator[torch.Tensor]:
    for w in windows:
        yield torch.as_tensor(w, dtype=torch.long, device=device).reshape(1, -1)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _hidden(args, kwargs) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _out(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@contextlib.contextmanager
def _hooks(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def calibration_loss(model: nn.Module, windows: Sequence[torch.Tensor]) -> float:
    """Mean next-token cross-entropy over the windows (nats per token)."""
    total, n = 0.0, 0
    for ids in _windows(windows, _device(model)):
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        n += ids.shape[1] - 1
    return total / max(n, 1)


@torch.no_grad()
def block_influence(model: nn.Module, windows: Sequence[torch.Tensor]) -> list[float]:
    """ShortGPT Block Influence of every decoder block (higher = more important)."""
    layers = decoder_layers(model)
    sums = [0.0] * len(layers)
    count = [0] * len(layers)

    def hook(i):
        def fn(_m, args, kwargs, output):
            x, y = _hidden(args, kwargs).float(), _out(output).float()
            cos = F.cosine_similarity(x, y, dim=-1)
            sums[i] += float((1 - cos).sum())
            count[i] += cos.numel()
        return fn

    with _hooks([layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]):
        for ids in _windows(windows, _device(model)):
            model(input_ids=ids, use_cache=False)
    return [s / max(c, 1) for s, c in zip(sums, count)]


@torch.no_grad()
def block_loss_increase(model: nn.Module, windows: Sequence[torch.Tensor], progress=None) -> list[float]:
    """Rise of the calibration loss when each block alone is skipped (higher = more important)."""
    base = calibration_loss(model, windows)
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        skip = layer.register_forward_hook(
            lambda _m, args, kwargs, output: _replace(output, _hidden(args, kwargs)), with_kwargs=True
        )
        with _hooks([skip]):
            out.append(calibration_loss(model, windows) - base)
        if progress is not None:
            progress(i)
    return out


def _replace(output, hidden: torch.Tensor):
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    return hidden


@torch.no_grad()
def width_importance(model: nn.Module, windows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: head importance ``[L, H]`` and MLP channel importance ``[L, I]`` (Minitron)."""
    s = shape(model.config)
    layers = decoder_layers(model)
    heads = torch.zeros(len(layers), s["heads"], dtype=torch.float64)
    chans = torch.zeros(len(layers), s["intermediate"], dtype=torch.float64)
    tokens = [0]

    def head_hook(i):
        def fn(_m, args):
            x = args[0].detach().float()
            x = x.reshape(-1, s["heads"], s["head_dim"])
            heads[i] += x.norm(dim=-1).sum(0).double().cpu()
            if i == 0:
                tokens[0] += x.shape[0]
        return fn

    def chan_hook(i):
        def fn(_m, args):
            x = args[0].detach().float()
            chans[i] += x.reshape(-1, x.shape[-1]).abs().sum(0).double().cpu()
        return fn

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(head_hook(i)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(chan_hook(i)))
    with _hooks(handles):
        for ids in _windows(windows, _device(model)):
            model(input_ids=ids, use_cache=False)
    n = max(tokens[0], 1)
    return heads / n, chans / n


@torch.no_grad()
def input_norms(model: nn.Module, names: Sequence[str], windows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``||X_j||_2`` per input channel of each named Linear over all calibration tokens."""
    mods = dict(model.named_modules())
    sq = {n: torch.zeros(mods[n].in_features, dtype=torch.float64) for n in names}

    def hook(name):
        def fn(_m, args):
            x = args[0].detach().float()
            sq[name] += x.reshape(-1, x.shape[-1]).pow(2).sum(0).double().cpu()
        return fn

    with _hooks([mods[n].register_forward_pre_hook(hook(n)) for n in names]):
        for ids in _windows(windows, _device(model)):
            model(input_ids=ids, use_cache=False)
    return {n: v.sqrt().float() for n, v in sq.items()}


@torch.no_grad()
def hidden_importance(model: nn.Module, windows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per residual-stream channel ``[hidden]``: mean ``|norm output|`` summed over the norms."""
    hidden = shape(model.config)["hidden"]
    mods = dict(model.named_modules())
    names = hidden_norms(model, hidden)
    total = torch.zeros(hidden, dtype=torch.float64)
    tokens = [0]

    def hook(first):
        def fn(_m, _args, output):
            x = _out(output).detach().float().reshape(-1, hidden)
            total.add_(x.abs().sum(0).double().cpu())
            if first:
                tokens[0] += x.shape[0]
        return fn

    with _hooks([mods[n].register_forward_hook(hook(i == 0)) for i, n in enumerate(names)]):
        for ids in _windows(windows, _device(model)):
            model(input_ids=ids, use_cache=False)
    return total / max(tokens[0], 1)
