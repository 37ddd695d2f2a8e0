"""Prefill and decode latency through a Runner: warm-up, then the median of several runs.

Prefill is the time to process the prompt from an empty cache and return the last logits;
decode is tokens/s over single-token steps after that prefill (greedy, so the work is the
same as in real generation).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from export.runtime import Runner


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
    prompt = prompt.reshape(-1)
    limit = runner.max_seq_len
    if limit is not None and prompt.numel() + decode_tokens > limit:
        decode_tokens = max(1, limit - prompt.numel())
    prefill, decode = [], []
    with torch_threads(threads):
        for i in range(warmup + runs):
            runner.reset()
            t0 = time.perf_counter()
            logits = runner.forward(prompt, all_logits=False)
            t1 = time.perf_counter()
            nxt = torch.argmax(logits[-1]).view(1)
            for _ in range(decode_tokens):
                logits = runner.forward(nxt, all_logits=False)
                nxt = torch.argmax(logits[-1]).view(1)
            t2 = time.perf_counter()
            if i >= warmup:
                prefill.append((t1 - t0) * 1000.0)
                decode.append(decode_tokens / (t2 - t1))
    return {
        "prefill_ms": statistics.median(prefill),
        "prefill_tokens": int(prompt.numel()),
        "decode_tok_s": statistics.median(decode),
        "decode_tokens": decode_tokens,
        "runs": runs,
        "warmup": warmup,
        "threads": threads,
    }
