"""Decoder blocks' inputs cached between blocks, for block-by-block calibration (GPTQ).

Sequential calibration quantizes block ``k`` on what the already-quantized blocks before it
output. Re-running the model from its input for every block costs a forward through ``k``
blocks for block ``k`` (quadratic in depth); :class:`BlockChain` records each block's call
arguments once and carries the hidden states from block to block instead.
"""

from __future__ import annotations

import torch
from torch import nn


class _NotRecordable(Exception):
    """A block was called without a hidden-states tensor first."""


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class BlockChain:
    """The calibration windows' hidden states between decoder blocks, so sequential GPTQ runs each
    block once per window instead of re-running every earlier block (quadratic in depth).

    One forward per window (cache off) records each block's call arguments (attention masks and
    position embeddings differ per layer type in sliding-window models) and the first block's
    input. The chain is used only if replaying block ``i`` on block ``i``'s recorded input gives
    block ``i + 1``'s recorded input on the first window, i.e. the blocks really feed each other
    and nothing else; otherwise ``ok`` is False and ``why`` says why.
    """

    def __init__(self, model: nn.Module, blocks: list[str]):
        self.mods = [model.get_submodule(b) for b in blocks]
        self.calls: list[list[tuple[tuple, dict]]] = [[] for _ in blocks]
        self.hidden: list[torch.Tensor] = []  # current input of the next block, one per window
        self.first_inputs: list[torch.Tensor] = []  # every block's input on window 0 (for the check)
        self.ok, self.why = True, ""

    @classmethod
    @torch.no_grad()
    def capture(cls, model: nn.Module, blocks: list[str], windows: list[torch.Tensor]) -> "BlockChain":
        chain = cls(model, blocks)
        handles = []
        win = {"j": 0}

        def hook(i):
            def fn(_mod, args, kwargs):
                hidden = args[0] if args else kwargs.get("hidden_states")
                if not isinstance(hidden, torch.Tensor):
                    raise _NotRecordable
                rest = dict(kwargs)
                rest.pop("hidden_states", None)
                chain.calls[i].append((tuple(args[1:]), rest))
                if i == 0:
                    chain.hidden.append(hidden.detach().clone())
                if win["j"] == 0:
                    chain.first_inputs.append(hidden.detach().clone())
            return fn

        for i, mod in enumerate(chain.mods):
            handles.append(mod.register_forward_pre_hook(hook(i), with_kwargs=True))
        try:
            for j, w in enumerate(windows):
                win["j"] = j
                model(w.view(1, -1), use_cache=False)
        except (_NotRecordable, TypeError) as exc:
            chain.ok, chain.why = False, f"the decoder blocks' inputs could not be recorded ({type(exc).__name__})"
        finally:
            for h in handles:
                h.remove()
        if chain.ok and any(len(c) != len(windows) for c in chain.calls):
            chain.ok, chain.why = False, "a decoder block ran a different number of times than there are windows"
        if chain.ok:
            chain._check()
        return chain

    def _check(self) -> None:
        """Replaying block i on its recorded input must give block i+1's recorded input (window 0)."""
        for i in range(len(self.mods) - 1):
            args, kwargs = self.calls[i][0]
            out = _first(self.mods[i](self.first_inputs[i], *args, **kwargs))
            want = self.first_inputs[i + 1]
            tol = 1e-5 * max(float(want.abs().max()), 1.0)
            if out.shape != want.shape or not torch.allclose(out, want, rtol=1e-5, atol=tol):
                self.ok, self.why = False, f"decoder block {i} does not feed block {i + 1} directly"
                return
        self.first_inputs = []

    @torch.no_grad()
    def run_block(self, i: int) -> None:
        """Run block ``i`` on every window's current input (its Linears' hooks see the inputs)."""
        for j, hidden in enumerate(self.hidden):
            args, kwargs = self.calls[i][j]
            self.mods[i](hidden, *args, **kwargs)

    @torch.no_grad()
    def advance(self, i: int) -> None:
        """Replace every window's input by block ``i``'s output (with block ``i`` as it is now)."""
        self.hidden = [_first(self.mods[i](h, *self.calls[i][j][0], **self.calls[i][j][1]))
                       for j, h in enumerate(self.hidden)]
