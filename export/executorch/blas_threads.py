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

Threaded MKL there is also not repeatable: two greedy decodes of the demo's ``.pte`` in one process,
``MKL_NUM_THREADS`` unset, diverged at token 23 of 96 (2026-12-07), as the attention's sums were
split differently from call to call.

What:

* :func:`serial_torch` runs each ExecuTorch call with MKL at one thread everywhere: the calling
  thread drops to one intra-op thread (``torch.set_num_threads``, which MKL reads there), and MKL's
  process-wide default, which ExecuTorch's workers read, is set to one through the setter libtorch
  exports (:class:`ProcessMkl`); both are restored after the call, so eager work between calls
  keeps its threads. This needs nothing from the environment: an embedded user who imported torch
  first gets the same tokens every time. Where torch has MKL but no setter can be found (another
  build), :func:`require_serial_mkl` refuses the program in one line unless ``MKL_NUM_THREADS=1``.
* :func:`serial_mkl_env` sets ``MKL_NUM_THREADS=1`` unless the user set it, before torch loads,
  and says how many threads eager torch should keep; :func:`apply` gives them back to the main
  thread with ``torch.set_num_threads`` (torch would otherwise take ``MKL_NUM_THREADS`` as its own
  default and run eager single-threaded). The CLI and the benchmarks call both, which also keeps
  eager torch's other threads off MKL's pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from typing import Iterator, MutableMapping


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


class ProcessMkl:
    """MKL's process-wide thread count, which a thread without a count of its own (ExecuTorch's workers) uses.

    torch links MKL statically and exports its service setter (``mkl_serv_set_num_threads``, what MKL's
    ``mkl_set_num_threads`` calls); ``mkl_get_max_threads`` read on a new thread gives the default."""

    def __init__(self, setter, getter):
        self._set, self._get = setter, getter
        self.default = self._read_default()

    def _read_default(self) -> int:
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(int(self._get())))
        t.start()
        t.join()
        return out[0]

    def set(self, n: int) -> None:
        self._set(int(n))


@functools.lru_cache(maxsize=1)
def process_mkl() -> ProcessMkl | None:
    """The MKL that libtorch carries, or None where torch was built without MKL or exports no setter."""
    import torch

    if not torch.backends.mkl.is_available():
        return None
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = os.path.join(lib_dir, name)
        if not os.path.exists(path):
            continue
        lib = ctypes.CDLL(path)
        for set_name in ("mkl_serv_set_num_threads", "MKL_Set_Num_Threads"):
            setter, getter = getattr(lib, set_name, None), getattr(lib, "mkl_get_max_threads", None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                return ProcessMkl(setter, getter)
    return None


def require_serial_mkl() -> None:
    """Refuse, in one line, a process where MKL may thread inside ExecuTorch's custom ops and cannot be made
    serial at run time (a torch with MKL but no setter found) and ``MKL_NUM_THREADS`` is not 1."""
    import torch

    if (torch.backends.mkl.is_available() and process_mkl() is None
            and os.environ.get("MKL_NUM_THREADS") != "1"):
        from export.decoding.runtime import RunnerError

        raise RunnerError("this torch build's MKL exposes no thread setter, and threaded MKL inside llama::custom_sdpa "
                          "makes decoding unrepeatable: set MKL_NUM_THREADS=1 before importing torch")


@contextlib.contextmanager
def serial_torch() -> Iterator[None]:
    """Run ExecuTorch with libtorch at one intra-op thread on the calling thread and MKL at one thread on every
    thread, then restore both.

    The calling thread takes a share of ``llama::custom_sdpa``'s parallel work, and there MKL uses
    the thread's own setting (``torch.set_num_threads``): at 2 it threads each small attention GEMM
    against XNNPACK's workers, and libtorch's OpenMP workers that a caller's torch op (an argmax over
    the logits) woke up spin for a core meanwhile. Measured on SmolLM2 all-4-bit, 2 cores,
    ``MKL_NUM_THREADS=1``, prefill-128 then 64 greedy steps: 2 torch threads 108-127 ms and
    120-136 tok/s, 1 thread 70-92 ms and 240-258 tok/s. ``torch.set_num_threads`` costs microseconds."""
    import torch

    n = torch.get_num_threads()
    mkl = process_mkl()
    mkl = mkl if mkl is not None and mkl.default != 1 else None
    if n == 1 and mkl is None:
        yield
        return
    torch.set_num_threads(1)
    if mkl is not None:
        mkl.set(1)
    try:
        yield
    finally:
        if mkl is not None:
            mkl.set(mkl.default)
        torch.set_num_threads(n)
