"""Interleaved timing of several ``.pte`` files on a shared host, with ratios paired per round.

A 2-core benchmark host is rarely quiet: another process on one core makes XNNPACK's 2-thread
kernels wait for their second thread, and the same ``.pte`` then decodes 2-3x slower. Timing
one row after another carries that drift into the ratios between rows. Here every file is
timed once per round, round-robin, so a disturbance hits all rows of a round alike; the ratio
against a reference row is taken *within* each round and its median reported (a paired
statistic), beside each row's median and best (least disturbed) figures. The host's load
average and CPU steal time are recorded with the figures so a disturbed run can be told apart.

Used by ``bench/executorch.py`` and ``bench/compress.py``.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass
class Samples:
    """One row's per-round timings (ms for prefill, tokens/s for decode)."""

    prefill_ms: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    prefill_long_ms: list[float] = field(default_factory=list)
    #: ExecuTorch's C++ text runner (its own Stats) on the same prompt, in the same rounds
    cpp_prefill_ms: list[float] = field(default_factory=list)
    cpp_decode_tok_s: list[float] = field(default_factory=list)


def _cpu_times() -> tuple[float, float]:
    """(total, steal) jiffies from /proc/stat (Linux); zeros elsewhere."""
    try:
        parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0, 0.0
    vals = [float(x) for x in parts]
    return sum(vals[:8]), (vals[7] if len(vals) > 7 else 0.0)


class HostMonitor:
    """Load average and CPU steal over a measured interval (what tells a disturbed run)."""

    def __init__(self) -> None:
        self.start_load = os.getloadavg()[0]
        self._t0 = _cpu_times()

    def report(self) -> dict:
        total, steal = _cpu_times()
        d_total, d_steal = total - self._t0[0], steal - self._t0[1]
        return {"load_avg_start": round(self.start_load, 2), "load_avg_end": round(os.getloadavg()[0], 2),
                "steal_pct": round(100.0 * d_steal / d_total, 2) if d_total > 0 else None}


def prefill_ms(runner, ids: torch.Tensor, runs: int = 1, warmup: int = 1) -> float:
    """Median time of one prefill of ``ids`` from a clean cache (no decode after it)."""
    times = []
    for i in range(warmup + runs):
        runner.reset()
        t0 = time.perf_counter()
        runner.forward(ids, all_logits=False)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000.0)
    runner.reset()
    return statistics.median(times)


def round_robin(ptes: dict[str, Path], prompt: torch.Tensor, decode_tokens: int, rounds: int, threads: int,
                long_prompt: torch.Tensor | None = None, log: Callable[[str], None] = print,
                tokenizer=None) -> dict[str, Samples]:
    """Time every ``.pte`` once per round (prefill of ``prompt``, ``decode_tokens`` greedy steps,
    and a prefill of ``long_prompt`` when given), ``rounds`` rounds, rows in the same order.
    With ``tokenizer`` (transformers', to give the C++ runner the prompt as text), ExecuTorch's
    C++ text runner is timed in the same rounds too, for the files it can run."""
    from export.executorch.llm_runner import LLMRunnerUnavailable
    from export.executorch.runner import ExecuTorchRunner
    from export.verify import latency

    out = {k: Samples() for k in ptes}
    no_cpp: set[str] = set()
    for i in range(rounds):
        log(f"timing round {i + 1}/{rounds} over {len(ptes)} .pte files")
        for key, path in ptes.items():
            runner = ExecuTorchRunner(path, threads=threads)  # sizes ExecuTorch's threadpool
            lat = latency(runner, prompt, decode_tokens, runs=1, warmup=1)
            out[key].prefill_ms.append(lat["prefill_ms"])
            out[key].decode_tok_s.append(lat["decode_tok_s"])
            if long_prompt is not None:
                out[key].prefill_long_ms.append(prefill_ms(runner, long_prompt))
            if tokenizer is not None and key not in no_cpp:
                try:
                    llm = runner.llm_runner()
                    text, num_bos = llm.prompt_for(tokenizer, prompt.tolist(), strict=False)
                    st = llm.timed(text, decode_tokens, num_bos=num_bos, runs=1, warmup=1)
                    out[key].cpp_prefill_ms.append(st["prefill_ms"])
                    out[key].cpp_decode_tok_s.append(st["decode_tok_s"])
                except LLMRunnerUnavailable as exc:
                    log(f"{key}: C++ runner not timed: {exc}")
                    no_cpp.add(key)
            runner.close()
    return out


def summarize(samples: dict[str, Samples], reference: str | None = None) -> dict[str, dict]:
    """Per row: medians, the best decode (least disturbed round) and, against ``reference``,
    the median over rounds of the within-round ratio (ours / reference; prefill: lower is
    better, decode: higher)."""
    res: dict[str, dict] = {}
    ref = samples.get(reference) if reference else None
    for key, s in samples.items():
        row = {"prefill128_ms": statistics.median(s.prefill_ms), "decode_tok_s": statistics.median(s.decode_tok_s),
               "decode_best": max(s.decode_tok_s), "prefill128_best": min(s.prefill_ms),
               "decode_samples": [round(x, 1) for x in s.decode_tok_s],
               "prefill128_samples": [round(x, 1) for x in s.prefill_ms]}
        if s.prefill_long_ms:
            row["prefill512_ms"] = statistics.median(s.prefill_long_ms)
        if ref is not None:
            row["paired_x_ref"] = {
                "decode": statistics.median(a / b for a, b in zip(s.decode_tok_s, ref.decode_tok_s)),
                "prefill128": statistics.median(a / b for a, b in zip(s.prefill_ms, ref.prefill_ms)),
            }
            if s.prefill_long_ms and ref.prefill_long_ms:
                row["paired_x_ref"]["prefill512"] = statistics.median(
                    a / b for a, b in zip(s.prefill_long_ms, ref.prefill_long_ms))
            if len(s.cpp_decode_tok_s) == len(ref.cpp_decode_tok_s) == len(s.decode_tok_s):
                row["paired_x_ref"]["cpp_decode"] = statistics.median(
                    a / b for a, b in zip(s.cpp_decode_tok_s, ref.cpp_decode_tok_s))
                row["paired_x_ref"]["cpp_prefill128"] = statistics.median(
                    a / b for a, b in zip(s.cpp_prefill_ms, ref.cpp_prefill_ms))
        if s.cpp_decode_tok_s:
            row.update(cpp_prefill128_ms=statistics.median(s.cpp_prefill_ms),
                       cpp_decode_tok_s=statistics.median(s.cpp_decode_tok_s),
                       cpp_decode_samples=[round(x, 1) for x in s.cpp_decode_tok_s])
        res[key] = row
    return res
