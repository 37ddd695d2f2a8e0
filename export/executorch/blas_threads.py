"""Keep libtorch's MKL serial while ExecuTorch runs in a Python process, so ``llama::custom_sdpa``
does not fight XNNPACK for the cores.

Why: in a Python process, ExecuTorch's ``llama::custom_sdpa`` reaches libtorch's BLAS (MKL) from
ExecuTorch's thread-pool workers and from the calling thread, which takes a share of each
parallel loop. ``torch.set_num_threads`` pins MKL with ``mkl_set_num_threads_local``, on the
calling thread only; on the workers MKL uses its process default, every core, unless
``MKL_NUM_THREADS`` is set before MKL starts (setting it later changes nothing). Threaded MKL
then splits each small attention GEMM against XNNPACK's own threads. SmolLM2-135M all-4-bit
``.pte``, 2 cores (Sapphire Rapids), 128-token prefill then 64 greedy steps through
:class:`~export.executorch.runner.ExecuTorchRunner`: 155-181 ms and 64-73 tok/s as torch
leaves it; 79 ms and 225-228 tok/s with both fixes below (3.3x decode). An app that links
ExecuTorch without libtorch has no MKL and none of this.

What:

* :func:`serial_mkl_env` sets ``MKL_NUM_THREADS=1`` unless the user set it, before torch loads,
  and says how many threads eager torch should keep; :func:`apply` gives them back to the main
  thread with ``torch.set_num_threads`` (torch would otherwise take ``MKL_NUM_THREADS`` as its own
  default and run eager single-threaded). Entry points call both: the CLI, the benchmarks, the
  tests' conftest. A library user who imports torch first gets :func:`warn_if_threaded`'s
  warning when a program with the custom ops loads.
* :func:`serial_torch` drops the calling thread to one intra-op thread around each ExecuTorch
  call (the runners use it) and restores it after, so eager work between calls keeps its threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, MutableMapping

log = logging.getLogger(__name__)

_warned = False


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def serial_mkl_env(environ: MutableMapping[str, str] | None = None) -> int | None:
    """Set ``MKL_NUM_THREADS=1`` in ``environ`` (default ``os.environ``) when the user left it unset.

    Call before torch is imported. Returns the thread count eager torch should use
    (``OMP_NUM_THREADS`` or every CPU this process may run on), or None when the user set
    ``MKL_NUM_THREADS`` and nothing was changed."""
    env = os.environ if environ is None else environ
    if "MKL_NUM_THREADS" in env:
        return None
    env["MKL_NUM_THREADS"] = "1"
    try:
        n = int(env.get("OMP_NUM_THREADS", ""))
    except ValueError:
        n = 0
    return n if n > 0 else _cpus()


def apply(threads: int | None) -> None:
    """Give eager torch its ``threads`` back on this thread (None: leave torch as it is)."""
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def warn_if_threaded() -> bool:
    """Log once when MKL may thread inside ExecuTorch's custom ops (neither ``MKL_NUM_THREADS`` nor
    ``OMP_NUM_THREADS`` is 1). Returns whether it warned."""
    global _warned
    if _warned or "1" in (os.environ.get("MKL_NUM_THREADS"), os.environ.get("OMP_NUM_THREADS")):
        return False
    _warned = True
    log.warning(
        "MKL_NUM_THREADS is not 1: llama::custom_sdpa's BLAS (libtorch's MKL) may thread on ExecuTorch's "
        "workers and make decode up to 3x slower. Set MKL_NUM_THREADS=1 before importing torch (the "
        "optimize CLI does this itself)."
    )
    return True


@contextlib.contextmanager
def serial_torch() -> Iterator[None]:
    """Run ExecuTorch with libtorch at one intra-op thread on the calling thread, then restore it.

    The calling thread takes a share of ``llama::custom_sdpa``'s parallel work, and there MKL uses
    the thread's own setting (``torch.set_num_threads``): at 2 it threads each small attention GEMM
    against XNNPACK's workers, and libtorch's OpenMP workers that a caller's torch op (an argmax over
    the logits) woke up spin for a core meanwhile. Measured on SmolLM2 all-4-bit, 2 cores,
    ``MKL_NUM_THREADS=1``, prefill-128 then 64 greedy steps: 2 torch threads 108-127 ms and
    120-136 tok/s, 1 thread 70-92 ms and 240-258 tok/s. ``torch.set_num_threads`` costs microseconds."""
    import torch

    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
