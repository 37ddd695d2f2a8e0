"""How a decode step of one or more ``.pte`` files grows with the cache position, paired in one process.

    python bench/et_positions.py a.pte [b.pte ...] [--positions 10,100,160,400] [--steps 30] [--rounds 9]

Why: ``bench/executorch.py`` decodes positions 128-191 only, and timings of one program taken in
different processes differ by up to ±20% here, which hides a 10% difference between programs.
This tool loads every program in one process and, for each round, times ``--steps`` decode calls
(``forward(tokens[1, 1], input_pos)``, no profiler) of each program at each position in turn, so
every ratio compares calls made seconds apart. It prints, per position, each program's median ms
per step and the median over rounds of its ratio to the first program.

What it shows on SmolLM2-135M: a step costs about 3 ms at position 10 and 6 ms at 400 in both our
all-4-bit program and optimum-executorch's, so from a few hundred tokens on ``llama::custom_sdpa``
is as large as all the projections together.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# As a script this folder comes first on sys.path, where bench/executorch.py would shadow the real
# ``executorch`` package; the repository root goes there instead.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import load_pte_module, parse_positions, positions_table, print_results  # noqa: E402


def load(pte: Path, threads: int):
    """A program's ``forward`` through ExecuTorch's pybindings (one token at ``input_pos`` [1] fits both
    conventions: the positions of the fed tokens, or the start position)."""
    return load_pte_module(pte, threads)


def sweep(ptes: list[Path], positions: list[int], *, steps: int = 30, rounds: int = 9, threads: int = 2) -> dict:
    """Median ms per decode step of each program at each position, and its ratio to the first program."""
    import torch

    if not ptes or not positions or steps < 1 or rounds < 1:
        raise ValueError("sweep needs at least one .pte and one position, steps >= 1 and rounds >= 1")
    if min(positions) < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    # MKL inside custom_sdpa must stay serial: on ExecuTorch's workers only MKL_NUM_THREADS (set before
    # torch loads; main() does it) reaches it (export/executorch/blas_threads.py); one intra-op thread covers the
    # calling thread, which takes a share of each parallel_for.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        programs = [load(p, threads) for p in ptes]
        ids = torch.tensor([[1000]])
        times = {(i, pos): [] for i in range(len(ptes)) for pos in positions}
        for r in range(rounds + 1):  # round 0 warms every program at every position
            for pos in positions:
                arg = torch.tensor([pos])
                for i, module in enumerate(programs):
                    t0 = time.perf_counter()
                    try:
                        for _ in range(steps):
                            module.forward((ids, arg))
                    except Exception as exc:  # e.g. a position past the program's cache
                        raise RuntimeError(f"{ptes[i]}: a decode step at position {pos} failed ({exc}); "
                                           "is the position inside the program's max_seq_len?") from None
                    if r:
                        times[i, pos].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        torch.set_num_threads(before)
    out = {"ptes": [str(p) for p in ptes], "steps": steps, "rounds": rounds, "threads": threads, "positions": {}}
    for pos in positions:
        base = times[0, pos]
        out["positions"][pos] = [
            {"ms": statistics.median(times[i, pos]),
             "ratio": statistics.median(t / b for t, b in zip(times[i, pos], base))}
            for i in range(len(ptes))
        ]
    return out


def table(res: dict) -> str:
    names = [Path(p).parent.name if Path(p).name == "model.pte" else Path(p).name for p in res["ptes"]]
    lines = positions_table(names, res["positions"])
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pte", nargs="+", type=Path, help="programs to compare; ratios are to the first")
    ap.add_argument("--positions", default="10,100,160,400", help="comma-separated cache positions")
    ap.add_argument("--steps", type=int, default=30, help="decode calls per timing")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds over programs and positions (median)")
    ap.add_argument("--threads", type=int, default=2, help="ExecuTorch threadpool size")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    positions = parse_positions(ap, a.positions)
    res = sweep(a.pte, positions, steps=a.steps, rounds=a.rounds, threads=a.threads)
    return print_results(f"ms per decode step (1 token), median of {a.rounds} rounds of {a.steps} calls, "
                         f"{a.threads} threads, one process, libtorch intra-op threads 1", table(res), res, a.json)


if __name__ == "__main__":
    import os

    os.environ.setdefault("MKL_NUM_THREADS", "1")  # before torch loads (export/executorch/blas_threads.py)
    raise SystemExit(main())
