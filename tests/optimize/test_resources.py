"""Peak memory per row: what a span allocated shows in its peak, even once freed again."""

from __future__ import annotations

import mmap

import pytest
import torch
from cuda_marks import needs_cuda  # tests/optimize is on sys.path (its conftest)

from optimize.resources import PeakMemory, Resources


def test_a_freed_allocation_still_counts_in_the_span_peak():
    before = PeakMemory(torch.device("cpu")).start().stop()
    meter = PeakMemory(torch.device("cpu")).start()
    # 256 MiB of fresh pages, touched, then unmapped: an anonymous mmap rather than a tensor, whose
    # memory malloc may serve from pages an earlier test left resident (then RSS would not move)
    block = mmap.mmap(-1, 256 * 2**20)
    block.write(b"\1" * len(block))
    block.close()
    res = meter.stop()
    assert res.device == "cpu" and res.peak_cuda_mb is None
    assert res.peak_rss_delta_mb >= 200, res  # freed before stop, still the span's peak
    assert res.peak_rss_mb >= before.peak_rss_mb + 200
    quiet = PeakMemory(torch.device("cpu")).start().stop()
    assert quiet.peak_rss_delta_mb < 50, quiet  # a new span starts from what the process holds now


def test_merged_keeps_the_larger_peaks():
    a = Resources(device="cpu", peak_rss_mb=900.0, peak_rss_delta_mb=10.0)
    b = Resources(device="cpu", peak_rss_mb=800.0, peak_rss_delta_mb=300.0, peak_cuda_mb=None)
    assert a.merged(b) == Resources(device="cpu", peak_rss_mb=900.0, peak_rss_delta_mb=300.0)
    assert Resources(device="cpu").merged(a).peak_rss_mb == 900.0


@pytest.mark.gpu
@needs_cuda
def test_cuda_peak_counts_what_the_span_allocated():
    device = torch.device("cuda")
    held = torch.cuda.memory_allocated(device) / 2**20  # what earlier tests left allocated counts too
    meter = PeakMemory(device).start()
    block = torch.ones(64 * 2**20 // 4, device=device)  # 64 MiB
    del block
    res = meter.stop()
    # peak_cuda_mb is rounded to 0.1 MiB (seen on an H100: 129.1 - 65.15 = 63.95)
    assert res.device.startswith("cuda") and 64 - 0.1 <= res.peak_cuda_mb - held < 64 + 32, (res, held)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's malloc_trim is Linux's")
def test_release_free_heap_gives_freed_heap_blocks_back():
    """Freed 64 KiB blocks with live ones between them stay resident (glibc trims only the heap's
    top by itself) until ``release_free_heap`` hands their pages back."""
    import subprocess
    import sys

    code = """
import torch
from optimize.resources import _status_mib, release_free_heap
torch.set_num_threads(1)
blocks = [torch.ones(16384) for _ in range(8192)]  # 64 KiB each: from the heap, not mmapped; 512 MiB
keep = blocks[::16]
del blocks
before = _status_mib("VmRSS")
ok = release_free_heap()
print(ok, before - _status_mib("VmRSS"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    assert float(out[1]) >= 300, out  # of the 480 MiB freed between the kept blocks
