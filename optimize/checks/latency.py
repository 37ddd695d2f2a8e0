"""Latency through a Runner with the thread count pinned (the measurement itself is
:func:`export.verify.latency`: warm-up, then the median of several runs).

An eager model on a GPU is timed through :class:`_Synchronized`: CUDA queues its work and
returns at once, so without waiting for it the wall-clock timer would measure kernel launches.
"""

from __future__ import annotations

import contextlib

import torch

from export.decoding.runtime import Runner
from export.verify import latency
from optimize.device import model_device, synchronize


@contextlib.contextmanager
def torch_threads(n: int | None):
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _Synchronized:
    """``runner`` whose forward returns only once the device has finished it (the rest is the runner's)."""

    def __init__(self, runner: Runner, device: torch.device):
        self._runner, self._device = runner, device

    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        out = self._runner.forward(ids, all_logits=all_logits)
        synchronize(self._device)
        return out

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


def synchronized(runner: Runner) -> Runner:
    """``runner`` as a timer must see it: waiting for the GPU when it runs an eager model there."""
    model = getattr(runner, "model", None)
    if isinstance(model, torch.nn.Module) and model_device(model).type == "cuda":
        return _Synchronized(runner, model_device(model))  # type: ignore[return-value]
    return runner


def measure_latency(
    runner: Runner, prompt: torch.Tensor, decode_tokens: int, *, runs: int = 3, warmup: int = 1, threads: int | None = 2
) -> dict:
    """Prefill ms and decode tok/s; decode is shortened to fit the runner's ``max_seq_len``."""
    prompt = prompt.reshape(-1)
    limit = runner.max_seq_len
    if limit is not None and prompt.numel() + decode_tokens > limit:
        decode_tokens = max(1, limit - prompt.numel())
    with torch_threads(threads):
        res = latency(synchronized(runner), prompt, decode_tokens, runs=runs, warmup=warmup)
    return {**res, "prefill_tokens": res["prompt_tokens"], "threads": threads}
