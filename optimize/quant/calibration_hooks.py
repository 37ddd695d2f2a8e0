"""The hooks of a calibration forward: what the target Linears receive, summed as Hessians, and an
early stop once the last of them has its input.

Sequential GPTQ (:mod:`optimize.quant.gptq_sequential`) runs every decoder block on every
calibration window with both installed: :class:`HessianCollector` accumulates ``sum x x^T`` per
input (each window's product in float32, summed in float64, on the int8 activations the shipped kernel multiplies where the scheme has
them), and :class:`StopAfterLastInput` ends the forward where the rest of the block computes
nothing the calibration reads.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from optimize.quant.fakequant import WeightScheme, qdq_act


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T x`` ([n, d] -> [d, d]) from products of column blocks on and above the diagonal,
    mirrored below it: a symmetric result for about 5/8 of the full product's work (4 blocks), each
    entry still one product over the ``n`` rows. On SmolLM2's 1536-wide input it took 8.6 ms
    instead of 11.1 ms a window, with the same values."""
    d = x.shape[-1]
    blocks = 4 if d >= 1024 else 3 if d >= 384 else 1
    if blocks == 1:
        return x.t() @ x
    step = -(-d // blocks)
    out = torch.empty((d, d), dtype=x.dtype, device=x.device)
    for i in range(0, d, step):
        part = x[:, i : i + step].t() @ x[:, i:]
        out[i : i + step, i:] = part
        out[i + step :, i : i + step] = part[:, step:].t()
    return out


class HessianCollector:
    """Accumulates ``sum x x^T`` over the inputs a set of Linears receive (one Hessian per input)."""

    def __init__(self, model: nn.Module, names: list[str], scheme: WeightScheme | None = None):
        self.model, self.scheme = model, scheme
        self.h: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        # q/k/v (and gate/up) receive the very same input tensor one after another: its x^T x is
        # computed once and reused while that tensor is unchanged
        self._last: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._handles = [model.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in names]

    def _outer(self, inp: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is not None and last[0] is inp and last[1] == inp._version:
            return last[2]
        x = inp.detach()
        x = (x if x.dtype == torch.float64 else x.float()).reshape(-1, inp.shape[-1])  # float64 calibration stays so
        if self.scheme is not None:  # the int8 activations the shipped kernel multiplies
            x = qdq_act(x, self.scheme)
        # the product in float32 (BLAS, the same on every ATen path), one window's tokens summed per
        # call; the caller sums the windows in float64. In float64 it took twice as long: a third
        # of SmolLM2's GPTQ stage
        xtx = gram(x.float()).double()
        self._last = (inp, inp._version, xtx)
        return xtx

    def _hook(self, name: str) -> Callable:
        def fn(_mod, args):
            xtx = self._outer(args[0])
            if name not in self.h:
                self.h[name] = torch.zeros_like(xtx)
                self.tokens[name] = 0
            self.h[name] += xtx
            self.tokens[name] += args[0].numel() // args[0].shape[-1]

        return fn

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._last = None


class StopForward(Exception):
    """Raised by a hook to end a calibration forward whose remaining outputs nothing reads."""


class StopAfterLastInput:
    """Ends a calibration forward once every target Linear has received its input.

    What runs after that (the down projection and the residual of a block; a 49152-wide output
    head in float64, about 1.2 s a window on one core) computes outputs the calibration throws away.
    Registered after the :class:`HessianCollector`'s hooks, so the collector sees the last input
    first. Only where the first window called each target exactly once (a dense model): where a
    Linear runs a data-dependent number of times (a mixture of experts' routed experts), a later
    window may call it again after the others, and every window runs to the end instead."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.names, self.armed = set(names), False
        self.seen: dict[str, int] = {}
        self._handles = [model.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in names]

    def _hook(self, name: str) -> Callable:
        def fn(_mod, _args):
            self.seen[name] = self.seen.get(name, 0) + 1
            if self.armed and len(self.seen) == len(self.names):
                raise StopForward
        return fn

    def window(self, run: Callable[[], None]) -> None:
        """One window's forward; the first one, run whole, decides whether later ones may stop."""
        self.seen = {}
        try:
            run()
        except StopForward:
            return
        if not self.armed:
            self.armed = set(self.seen) == self.names and all(n == 1 for n in self.seen.values())
            if not self.armed:
                self.close()  # a target ran other than once: no stopping for this step

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
