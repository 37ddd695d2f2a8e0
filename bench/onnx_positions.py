"""What ``verify_tokens`` costs an onnxruntime-genai folder: one-token steps against the cache position, and
verification calls in one-token steps, folders paired in one process.

    python bench/onnx_positions.py DIR [DIR ...] [--positions 50,150,300,600,1000] [--steps 10] [--rounds 5]

Why: a ``verify_tokens`` export (export/onnxruntime/verify_rows.py) puts one-token steps on the
attention path that returns probabilities, which the verification rows match, instead of ONNX
Runtime's flash decode kernel; that costs plain decoding more as the context grows, and a verification
call of T tokens costs what it costs. Timings of one folder taken in different processes differ by
more than those costs here, so every folder is loaded in one process and, per round and position,
each in turn prefills to the position and times ``--steps`` one-token calls (cut back to the position
after each, so every call sees the same cache), then, for a folder with the verification input, as
many calls of each length from 2 to its ``verify_tokens``. It prints, per position, each folder's
median ms per step and the median over rounds of its ratio to the first folder's, and each verifying
folder's calls in its own one-token steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import parse_positions, positions_table, print_results  # noqa: E402


def _open(folder: Path, threads: int):
    """The folder through onnxruntime-genai, its verifying runner where it has the input (else None)."""
    from export.onnxruntime.genai_runner import GenaiRunner
    from export.decoding.runtime import RunnerError

    if not (Path(folder) / "genai_config.json").is_file():
        raise FileNotFoundError(f"no onnxruntime-genai folder at {folder} (genai_config.json)")
    plain = GenaiRunner(Path(folder), intra_op_threads=threads)
    try:
        return plain, plain.speculative_runner()
    except RunnerError:
        return plain, None


def _timed(runner, pos: int, tokens: int, steps: int, gen) -> float:
    """Median seconds of ``steps`` calls of ``tokens`` tokens at ``pos``, each cut back after."""
    import torch

    from export.decoding.runtime import argmax_ids

    out = []
    for _ in range(steps):
        ids = torch.randint(100, 20000, (tokens,), generator=gen)
        t0 = time.perf_counter()
        argmax_ids(runner.forward(ids, all_logits=tokens > 1))
        out.append(time.perf_counter() - t0)
        runner.truncate(pos)
    return statistics.median(out)


def sweep(folders: list[Path], positions: list[int], *, steps: int = 10, rounds: int = 5, threads: int = 2) -> dict:
    """Per position: each folder's median ms per one-token step and its ratio to the first folder;
    per verifying folder and position: each call length's median cost in that folder's one-token steps."""
    import torch

    if not folders or not positions or steps < 1 or rounds < 1:
        raise ValueError("sweep needs at least one folder and one position, steps >= 1 and rounds >= 1")
    if min(positions) < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    runners = [_open(f, threads) for f in folders]
    gen = torch.Generator().manual_seed(0)
    step = {(i, pos): [] for i in range(len(folders)) for pos in positions}
    calls = {(i, pos, t): [] for i, (_, v) in enumerate(runners) if v is not None for pos in positions
             for t in range(2, v.verify_tokens + 1)}
    for r in range(rounds + 1):  # round 0 warms every folder at every position
        for pos in positions:
            prompt = torch.randint(100, 20000, (pos,), generator=gen)
            for i, (plain, verify) in enumerate(runners):
                runner = verify or plain
                runner.reserve(pos + 64)
                runner.reset()
                runner.forward(prompt, all_logits=False)
                one = _timed(runner, pos, 1, steps, gen)
                if r:
                    step[i, pos].append(one * 1e3)
                if verify is not None:
                    for t in range(2, verify.verify_tokens + 1):
                        cost = _timed(verify, pos, t, steps, gen) / one
                        if r:
                            calls[i, pos, t].append(cost)
    out = {"folders": [str(f) for f in folders], "steps": steps, "rounds": rounds, "threads": threads,
           "positions": {}, "verify_calls": {}}
    for pos in positions:
        out["positions"][pos] = [{"ms": statistics.median(step[i, pos]),
                                  "ratio": statistics.median(a / b for a, b in zip(step[i, pos], step[0, pos]))}
                                 for i in range(len(folders))]
    for (i, pos, t), v in calls.items():
        out["verify_calls"].setdefault(str(folders[i]), {}).setdefault(pos, {})[t] = statistics.median(v)
    return out


def _name(folder: str) -> str:
    p = Path(folder)
    return p.parent.parent.name if p.name == "onnxruntime" and p.parent.name == "export" else p.name


def table(res: dict) -> str:
    names = [_name(f) for f in res["folders"]]
    lines = positions_table(names, res["positions"])
    for folder, by_pos in res["verify_calls"].items():
        lengths = sorted({t for costs in by_pos.values() for t in costs})
        lines += ["", f"{_name(folder)}: a verification call of T tokens, in its one-token steps", "",
                  "| position | " + " | ".join(f"T={t}" for t in lengths) + " |", "|" + "---:|" * (len(lengths) + 1)]
        for pos, costs in by_pos.items():
            lines.append(f"| {pos} | " + " | ".join(f"{costs[t]:.2f}" for t in lengths) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="+", type=Path, help="onnxruntime-genai folders to compare; ratios are to the first")
    ap.add_argument("--positions", default="50,150,300,600,1000", help="comma-separated cache positions")
    ap.add_argument("--steps", type=int, default=10, help="calls per timing (median)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds over folders and positions (median)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    positions = parse_positions(ap, a.positions)
    res = sweep(a.folder, positions, steps=a.steps, rounds=a.rounds, threads=a.threads)
    return print_results(f"onnxruntime-genai, ms per one-token step, median of {a.rounds} rounds of {a.steps} calls, "
                         f"{a.threads} threads, one process", table(res), res, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
