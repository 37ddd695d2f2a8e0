"""Latency through a Runner with the thread count pinned (the measurement itself is
:func:`export.verify.latency`: warm-up, then the median of several runs)."""

from __future__ import annotations

import contextlib

import torch

from export.runtime import Runner
from export.verify import latency


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


def measure_latency(
    runner: Runner, prompt: torch.Tensor, decode_tokens: int, *, runs: int = 3, warmup: int = 1, threads: int | None = 2
) -> dict:
    """Prefill ms and decode tok/s; decode is shortened to fit the runner's ``max_seq_len``."""
    prompt = prompt.reshape(-1)
    limit = runner.max_seq_len
    if limit is not None and prompt.numel() + decode_tokens > limit:
        decode_tokens = max(1, limit - prompt.numel())
    with torch_threads(threads):
        res = latency(runner, prompt, decode_tokens, runs=runs, warmup=warmup)
    return {**res, "prefill_tokens": res["prompt_tokens"], "threads": threads}
