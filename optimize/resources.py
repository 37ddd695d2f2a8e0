"""What a pipeline row cost in memory: the process's peak resident memory (and what the row
added over what the process held when it started), and the CUDA allocator's peak on a GPU.

Why: a stage that fits on one machine and not on another (a 1B-class model on 24 GiB, GPTQ
on a GPU) is decided by its peak, not its average, and the report is where a run's cost is
read. The wall time is the runner's (``StageRow.wall_s``); this module measures the memory
over the same span.

How: on Linux the kernel's high-water mark of the resident set (``VmHWM``) is reset at the
start of the span (``/proc/self/clear_refs``) and read at its end, so short spikes count.
Code inside the span that resets it again (the training loop does, to report its own peak)
makes the figure the peak since that reset. Where the reset is not possible the RSS peak is
None rather than a lifetime figure that would mislead. On CUDA, ``torch.cuda`` keeps the peak
of allocated memory, reset the same way.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch
from pydantic import BaseModel, Field

from targets.process_memory import reset_peak_rss, status_bytes

MIB = 2**20


class Resources(BaseModel):
    """Where a row ran and its peak memory."""

    device: str = Field(description="where the row computed (cpu, cuda:0)")
    peak_rss_mb: float | None = Field(
        None, description="peak resident memory of the process during the row, MiB (None where it cannot be reset per row)"
    )
    peak_rss_delta_mb: float | None = Field(
        None, description="peak_rss_mb minus the resident memory when the row started: what the row needed on top, MiB"
    )
    peak_cuda_mb: float | None = Field(
        None, description="torch.cuda.max_memory_allocated during the row, MiB (None on the CPU)"
    )

    def merged(self, other: "Resources") -> "Resources":
        """The larger of two spans' peaks (an export and the verification of its artifact)."""
        def top(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        return Resources(device=self.device, peak_rss_mb=top(self.peak_rss_mb, other.peak_rss_mb),
                         peak_rss_delta_mb=top(self.peak_rss_delta_mb, other.peak_rss_delta_mb),
                         peak_cuda_mb=top(self.peak_cuda_mb, other.peak_cuda_mb))


def _status_mib(key: str) -> float | None:
    got = status_bytes(key)
    return got / 2**20 if got is not None else None


class PeakMemory:
    """Measures one span: ``meter = PeakMemory(device).start()`` ... ``meter.stop()`` -> :class:`Resources`."""

    def __init__(self, device: torch.device):
        self.device = device
        self._rss0: float | None = None
        self._rss_ok = False

    def start(self) -> "PeakMemory":
        self._rss_ok = reset_peak_rss()
        self._rss0 = _status_mib("VmRSS")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def stop(self) -> Resources:
        peak = delta = cuda = None
        if self._rss_ok:
            hwm, rss = _status_mib("VmHWM"), _status_mib("VmRSS")
            peak = max(v for v in (hwm, rss) if v is not None)
            delta = max(0.0, peak - self._rss0) if self._rss0 is not None else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            cuda = torch.cuda.max_memory_allocated(self.device) / MIB
        rnd = (lambda v: None if v is None else round(v, 1))
        return Resources(device=str(self.device), peak_rss_mb=rnd(peak), peak_rss_delta_mb=rnd(delta),
                         peak_cuda_mb=rnd(cuda))


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl): nothing to call
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give the heap memory a phase freed back to the OS (glibc's ``malloc_trim(0)``); False where
    there is no glibc.

    Why: glibc keeps freed small and medium blocks resident for reuse, but large allocations (a
    window's logits, a float64 Hessian) are mapped fresh and never reuse them, so after a phase
    that allocated and freed gigabytes the next phase's peak sits on top of memory nobody uses.
    A 1B-class model's run (4 blocks, the head at full size) peaked 420 MiB lower with the heap
    trimmed between stages and after each GPTQ block, with the same results. It takes milliseconds."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
