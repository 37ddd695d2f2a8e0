"""Decoder blocks' inputs cached between blocks, for block-by-block calibration (GPTQ).

Sequential calibration quantizes block ``k`` on what the already-quantized blocks before it
output. Re-running the model from its input for every block costs a forward through ``k``
blocks for block ``k`` (quadratic in depth); :class:`BlockChain` records each block's call
arguments once and carries the hidden states from block to block instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from optimize.device import to_device
from train.model_parts import forwards_replaced


class _NotRecordable(Exception):
    """A block was called without a hidden-states tensor first."""


class _PastLastBlock(Exception):
    """The capture forward stops once the last block has run: the output head's work is not needed."""


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _same(a, b) -> bool:
    """Whether two recorded call arguments are equal: tensors by value, containers item by item,
    anything else by ``==`` (an object that cannot say counts as different)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if a is None or isinstance(a, (bool, int, float, str)):
        return type(a) is type(b) and a == b
    return a is b


class BlockChain:
    """The calibration windows' hidden states between decoder blocks, so sequential GPTQ runs each
    block a fixed number of times per window (to calibrate it, then quantized to feed the next)
    instead of re-running every earlier block (quadratic in depth).

    One forward per window (cache off, stopped after the last block) records each block's call
    arguments (attention masks and position embeddings differ per layer type in sliding-window
    models), the first block's input and the shape of what each block returns. The chain is used
    only if replaying block ``i`` on block ``i``'s recorded input gives block ``i + 1``'s recorded
    input on the first window, i.e. the blocks really feed each other and nothing else; otherwise
    ``ok`` is False and ``why`` says why. :meth:`replay` then runs the model's head (final norm,
    output projection) on the carried hidden states without running any block again.
    """

    def __init__(self, model: nn.Module, blocks: list[str]):
        self.mods = [model.get_submodule(b) for b in blocks]
        self.calls: list[list[tuple[tuple, dict]]] = [[] for _ in blocks]
        self.hidden: list[torch.Tensor] = []  # current input of the next block, one per window
        self.first_inputs: list[torch.Tensor] = []  # every block's input on window 0 (for the check)
        #: what each block returns after its hidden states (window 0): None for a bare tensor, else the
        #: rest of its tuple/list (attention weights, caches), for :meth:`replay` to return alike
        self.tails: list[tuple | list | None] = [None for _ in blocks]
        self.ok, self.why = True, ""

    @classmethod
    @torch.no_grad()
    def capture(cls, model: nn.Module, blocks: list[str], windows: list[torch.Tensor]) -> "BlockChain":
        """Record every block's call arguments and the first block's input for each window.

        Only window 0 runs the blocks (the chain's check and the blocks' output form need their real
        outputs). The other windows pass through blocks that return their input unchanged, which
        costs the embedding alone instead of a forward through every block: on SmolLM2-135M with 32
        calibration windows in float64 that forward was a sixth of GPTQ's time. Why it is safe: the
        arguments a block receives besides its hidden states (position embeddings, masks) are made
        from the model's input, not from an earlier block's output; that is checked, not assumed,
        by recording window 0 a second time through the pass-through blocks and comparing. Any
        difference records every window with the real blocks."""
        chain = cls(model, blocks)
        handles = []
        state: dict = {"j": 0, "probe": None}  # probe: where a pass-through re-recording of window 0 goes

        def hook(i):
            def fn(_mod, args, kwargs):
                hidden = args[0] if args else kwargs.get("hidden_states")
                if not isinstance(hidden, torch.Tensor):
                    raise _NotRecordable
                rest = dict(kwargs)
                rest.pop("hidden_states", None)
                if state["probe"] is not None:
                    state["probe"].append((tuple(args[1:]), rest))
                    return
                chain.calls[i].append((tuple(args[1:]), rest))
                if i == 0:
                    chain.hidden.append(hidden.detach().clone())
                if state["j"] == 0:
                    chain.first_inputs.append(hidden.detach().clone())
            return fn

        def after(i):
            def fn(_mod, _args, out):
                if state["j"] == 0 and state["probe"] is None:
                    chain.tails[i] = out[1:] if isinstance(out, (tuple, list)) else None
                if i == len(chain.mods) - 1:
                    raise _PastLastBlock
            return fn

        def forward(w: torch.Tensor) -> None:
            try:
                model(w.view(1, -1), use_cache=False)
            except _PastLastBlock:
                pass

        for i, mod in enumerate(chain.mods):
            handles.append(mod.register_forward_pre_hook(hook(i), with_kwargs=True))
            handles.append(mod.register_forward_hook(after(i)))
        try:
            forward(windows[0])
            passing = False
            if len(windows) > 1:
                state["probe"] = []
                with chain._passing_through():
                    forward(windows[0])
                probe, state["probe"] = state["probe"], None
                passing = _same(probe, [c[0] for c in chain.calls])
            for j, w in enumerate(windows[1:], start=1):
                state["j"] = j
                if passing:
                    with chain._passing_through():
                        forward(w)
                else:
                    forward(w)
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

    @contextmanager
    def _passing_through(self, last: torch.Tensor | None = None) -> Iterator[None]:
        """While open, every block returns its input unchanged, in the form it returns its output;
        with ``last``, the last block returns ``last`` instead (:meth:`replay`'s carried states)."""
        final = len(self.mods) - 1

        def pass_through(i: int):
            def forward(*args, **kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                # the carried states may sit on the blocks' compute device; the head runs with the model
                return self._shaped(i, last.to(hidden.device) if last is not None and i == final else hidden)
            return forward

        with forwards_replaced(self.mods, lambda i, _mod: pass_through(i)):
            yield

    def _shaped(self, i: int, hidden: torch.Tensor):
        """``hidden`` in the form block ``i`` returns its output (recorded on window 0)."""
        tail = self.tails[i]
        return hidden if tail is None else type(tail)((hidden, *tail))

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

    def to(self, device: torch.device) -> "BlockChain":
        """Carry the hidden states and every block's recorded arguments on ``device``, where the
        blocks will run (one at a time, see :func:`optimize.device.on_device`)."""
        self.hidden = [h.to(device) for h in self.hidden]
        self.calls = [[to_device(call, device) for call in calls] for calls in self.calls]
        return self  # the tails stay with the model: replay hands them to its head

    @torch.no_grad()
    def run_block(self, i: int, j: int) -> None:
        """Run block ``i`` on window ``j``'s current input (its Linears' hooks see the input; the
        output is not kept)."""
        args, kwargs = self.calls[i][j]
        self.mods[i](self.hidden[j], *args, **kwargs)

    @torch.no_grad()
    def advance(self, i: int) -> None:
        """Replace every window's input by block ``i``'s output (with block ``i`` as it is now)."""
        self.hidden = [_first(self.mods[i](h, *self.calls[i][j][0], **self.calls[i][j][1]))
                       for j, h in enumerate(self.hidden)]

    @contextmanager
    def replay(self, j: int) -> Iterator[None]:
        """While open, every block returns its input unchanged and the last block returns window
        ``j``'s carried hidden states (call :meth:`advance` on the last block first), in the form
        each block returned them: a forward of the model on window ``j`` then runs only what lies
        outside the blocks (embedding, final norm, output head) and reaches the head with what the
        quantized blocks computed. Only valid for a chain that is ``ok`` (the blocks feed each other
        directly, so passing the input through is what the blocks in between would have carried)."""
        if not self.ok:
            raise RuntimeError(f"BlockChain.replay on a chain that is not usable: {self.why}")
        with self._passing_through(self.hidden[j]):
            yield
