"""Where one ``forward`` of a ``.pte`` spends its time, from ExecuTorch's own profiler (ETDump).

    python bench/et_profile.py model.pte [--tokens 1] [--position 128] [--calls 10] [--threads 2]

Fills the cache below ``--position`` (a prefill in chunks of 64, so attention reads real keys as in
generation), runs ``forward(tokens[1, T], input_pos)`` ``--calls`` times at that position (after a
warm-up), then groups every timed event of each call:

* **XNNPACK GEMMs** (``Fully Connected`` / ``Batch Matrix Multiply``) and **other XNNPACK ops**,
  as XNNPACK's per-op profiler reports them inside each delegate call;
* **delegate overhead**: the delegate calls' time minus the ops inside them. It holds XNNPACK's
  reshape and setup per call, thread hand-offs, and ETDump's own logging of every op, so it reads
  high: compare it between programs, not against the clock;
* **kernel calls** outside the delegate: ``llama::custom_sdpa``, ``llama::update_cache`` and the
  other portable kernels, each with its dispatch;
* the rest of ``Method::execute`` (instruction dispatch, memory planning).

Medians over calls, in ms. ``bench/executorch.py`` figures are without the profiler; this tool says
where a step goes, not how fast it is. Read the kernel rows with care: ETDump put our ``custom_sdpa``
at twice the peer's time per call, where ``perf`` over a plain decode loop (no ETDump) counts the
same samples in that kernel for both programs. The README's "Where the time goes" came from it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

# As a script this folder comes first on sys.path, where bench/executorch.py would shadow the real
# ``executorch`` package; the repository root goes there instead.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import load_pte_module, print_results  # noqa: E402

#: events that frame a call or a load rather than doing work of their own
_FRAME = {"Method::execute", "Program::load_method", "Method::init"}
_GEMM_PREFIXES = ("Fully Connected", "Batch Matrix Multiply")
_CUSTOM = {"llama::custom_sdpa.out": "custom_sdpa", "llama::update_cache.out": "update_cache",
           "llama::update_cache_with_indices.out": "update_cache"}


def group_call(events: list[tuple[str, bool, float]]) -> dict[str, float]:
    """Group one call's ``(name, is_delegated_op, ms)`` events (in program order) into the
    breakdown's rows. ``OPERATOR_CALL`` wraps the kernel event just before it and ``DELEGATE_CALL``
    the XNNPACK ops before it, so the wrappers' times are the ones summed, and the kernels' own
    events only say which kind of kernel each wrapper held."""
    out: dict[str, float] = defaultdict(float)
    count: dict[str, float] = defaultdict(float)
    pending_ops = 0.0
    last_kernel: str | None = None
    for name, delegated, ms in events:
        if delegated:
            kind = "xnnpack_gemm" if name.startswith(_GEMM_PREFIXES) else "xnnpack_other"
            out[kind] += ms
            count[kind] += 1
            pending_ops += ms
        elif name == "DELEGATE_CALL":
            out["delegate_calls"] += ms
            out["delegate_overhead"] += max(0.0, ms - pending_ops)
            count["delegate_calls"] += 1
            pending_ops = 0.0
        elif name == "OPERATOR_CALL":
            kind = _CUSTOM.get(last_kernel or "", "portable_kernels")
            out[kind] += ms
            count[kind] += 1
            last_kernel = None
        elif name == "Method::execute":
            out["execute"] += ms
        elif name not in _FRAME:
            last_kernel = name
    out["runtime_glue"] = max(0.0, out["execute"] - out["delegate_calls"] - sum(
        out[k] for k in ("custom_sdpa", "update_cache", "portable_kernels")))
    return {**out, **{f"n_{k}": v for k, v in count.items()}}


def breakdown(per_call: list[dict[str, float]]) -> dict[str, float]:
    """Median of every row over calls (rows a call lacks count as 0)."""
    keys = sorted({k for c in per_call for k in c})
    return {k: statistics.median(c.get(k, 0.0) for c in per_call) for k in keys}


#: prompt tokens per call when filling the cache before the timed calls
PREFILL_CHUNK = 64


def profile(pte: Path, *, tokens: int = 1, position: int = 128, calls: int = 10, warmup: int = 2,
            threads: int = 2) -> dict:
    """Run ``pte``'s forward under ETDump and return :func:`breakdown` of the timed calls.

    The cache below ``position`` is filled first (a prefill in chunks), so attention reads real
    keys, as in generation, and not whatever the arena held."""
    import torch
    from executorch.devtools import Inspector

    from export.executorch.blas_threads import serial_torch

    m = load_pte_module(pte, threads, enable_etdump=True, debug_buffer_size=0)
    pos_is_range = int(m.method_meta("forward").input_tensor_meta(1).sizes()[0]) > 1

    def call(start: int, n: int) -> None:
        chunk = torch.randint(100, 1000, (1, n), generator=torch.Generator().manual_seed(start))
        m.forward((chunk, torch.arange(start, start + n) if pos_is_range else torch.tensor([start])))

    with serial_torch():
        prefills = range(0, position, PREFILL_CHUNK)
        for start in prefills:
            call(start, min(PREFILL_CHUNK, position - start))
        for _ in range(warmup + calls):
            call(position, tokens)
    with tempfile.TemporaryDirectory(prefix="etdump-") as tdir:
        path = Path(tdir) / "run.etdp"
        m.write_etdump_result_to_file(str(path))
        insp = Inspector(etdump_path=str(path))
        events = [(ev.name, bool(ev.is_delegated_op), list(ev.perf_data.raw))
                  for block in insp.event_blocks for ev in block.events if ev.perf_data is not None]
    first = len(prefills) + warmup  # index of the first timed call
    executes = [raw for n, _, raw in events if n == "Method::execute"]
    if not executes or len(executes[0]) != first + calls:
        raise RuntimeError(f"ETDump holds {len(executes[0]) if executes else 0} forward calls for the "
                           f"{first + calls} made: the timed calls cannot be told apart")
    per_call = []
    for i in range(first, first + calls):
        per_call.append(group_call([(n, d, raw[i]) for n, d, raw in events if len(raw) > i]))
    return {"pte": str(pte), "tokens": tokens, "position": position, "calls": calls, "threads": threads,
            "prefill_calls": len(prefills), "ms": breakdown(per_call)}


ROWS = (("execute", "Method::execute"), ("xnnpack_gemm", "  XNNPACK GEMMs"),
        ("xnnpack_other", "  other XNNPACK ops"), ("delegate_overhead", "  delegate overhead (ETDump-inflated)"),
        ("custom_sdpa", "  llama::custom_sdpa"), ("update_cache", "  llama::update_cache"),
        ("portable_kernels", "  other kernels"), ("runtime_glue", "  runtime glue"))


def table(results: list[dict]) -> str:
    names = [Path(r["pte"]) for r in results]
    head = "| | " + " | ".join(p.parent.name if p.name == "model.pte" else p.name for p in names) + " |"
    lines = [head, "|---" + "|---:" * len(results) + "|"]
    for key, label in ROWS:
        cells = []
        for r in results:
            ms = r["ms"].get(key, 0.0)
            if key == "execute":
                cells.append(f"{ms:.3f}")
                continue
            share = ms / r["ms"]["execute"] if r["ms"].get("execute") else 0.0
            n = r["ms"].get("n_delegate_calls" if key == "delegate_overhead" else f"n_{key}")
            what = "delegate calls" if key == "delegate_overhead" else "calls"
            cells.append(f"{ms:.3f} ({share:.0%}" + (f", {n:.0f} {what})" if n else ")"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pte", nargs="+", type=Path, help="one or more .pte files (columns of the table)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per call: 1 = a decode step, 128 = a prefill")
    ap.add_argument("--position", type=int, default=128, help="start position of every call")
    ap.add_argument("--calls", type=int, default=10, help="timed calls (median) after 2 warm-up calls")
    ap.add_argument("--threads", type=int, default=2, help="ExecuTorch threadpool size")
    ap.add_argument("--json", type=Path, default=None, help="also write the breakdowns here")
    a = ap.parse_args(argv)
    results = [profile(p, tokens=a.tokens, position=a.position, calls=a.calls, threads=a.threads) for p in a.pte]
    return print_results(f"ms per forward of {a.tokens} token(s) at position {a.position}, median of {a.calls} "
                         f"calls, {a.threads} threads (ETDump)", table(results), results, a.json)


if __name__ == "__main__":
    import os

    os.environ.setdefault("MKL_NUM_THREADS", "1")  # before torch loads (export/executorch/blas_threads.py)
    raise SystemExit(main())
