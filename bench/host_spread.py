"""How much a recipe's accuracy depends on the host: the same stages under each ATen CPU path.

GPTQ's rounding decisions follow the float arithmetic of the matmuls that build its Hessians
and propagate its errors, and that arithmetic differs between the vector paths a CPU takes
(``ATEN_CPU_CAPABILITY=default|avx2|avx512``): the same recipe lands at different perplexities
on different hosts. This bench runs a pipeline YAML's *stages* (eager, no export: the gates
that stopped users fire there) once per path, each in a child process, and prints every
row's perplexity, the spread across paths, and each row's margin to the YAML's perplexity gate.

    .venv/bin/python bench/host_spread.py examples/smollm2_onnx_int4.yaml [--paths default,avx2,avx512]
        [--set key=value ...] [--json /tmp/host_spread.json]

A path the CPU lacks (avx512 on an AVX2-only host) runs ATen's best available one instead,
which ATen does silently; the table marks the paths this CPU's flags support.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, print_results, run_json_child  # noqa: E402

PATHS = ("default", "avx2", "avx512")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported(path: str, flags: set[str]) -> bool:
    return path == "default" or (path == "avx2" and "avx2" in flags) or (path == "avx512" and "avx512bw" in flags)


def _child(config: str, overrides: list[str], out: str) -> int:
    """Run the stages (target removed) and write {row: perplexity, gate} as JSON."""
    from optimize import load_config, run_pipeline
    from optimize.config import dump_config

    cfg = load_config(config, overrides)
    data = dump_config(cfg) | {"target": None, "output_dir": str(Path(out).parent / "run"), "resume": False}
    data["checks"]["latency"]["enabled"] = False
    data["checks"]["generate_tokens"] = 0
    data["gates"]["on_fail"] = "warn"  # measure every row, even past a failing one
    report = run_pipeline(load_config(data))
    gate = cfg.gates.perplexity.max_pct_degradation if cfg.gates.perplexity else None
    rows = [{"row": r.name, "perplexity": r.metrics.perplexity, "delta_pct": r.metrics.perplexity_delta_pct,
             "wall_s": r.wall_s} for r in report.rows if r.metrics and r.metrics.perplexity]
    Path(out).write_text(json.dumps({"rows": rows, "gate_pct": gate,
                                     "capability": os.environ.get("ATEN_CPU_CAPABILITY", "")}))
    return 0


def table(results: dict[str, dict], flags: set[str]) -> str:
    paths = [p for p in results if "rows" in results[p]]
    names = [r["row"] for r in results[paths[0]]["rows"]] if paths else []
    gate = next((results[p]["gate_pct"] for p in paths), None)
    head = "| row | " + " | ".join(f"{p}{'' if supported(p, flags) else ' (n/a here)'}" for p in paths)
    lines = [head + " | spread (pp) | worst margin to gate (pp) |", "|---|" + "---:|" * (len(paths) + 2)]
    for name in names:
        deltas = []
        cells = []
        for p in paths:
            row = next((r for r in results[p]["rows"] if r["row"] == name), None)
            if row is None:
                cells.append("–")
                continue
            deltas.append(row["delta_pct"] or 0.0)
            cells.append(f"{row['perplexity']:.3f} ({row['delta_pct']:+.2f}%)")
        spread = max(deltas) - min(deltas) if deltas else 0.0
        margin = f"{gate - max(deltas):+.2f}" if gate is not None and deltas and name != "baseline" else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {spread:.2f} | {margin} |")
    for p in results:
        if "error" in results[p]:
            lines.append(f"| ({p}) | failed: {results[p]['error']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="pipeline YAML whose stages are measured")
    ap.add_argument("--paths", default=",".join(PATHS), help="ATEN_CPU_CAPABILITY values, comma separated")
    ap.add_argument("--set", nargs="*", default=[], dest="overrides", help="key.path=value overrides")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.config, args.overrides, args.child)

    flags = cpu_flags()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="host_spread_") as tmp:
        for path in args.paths.split(","):
            out = Path(tmp) / path / "result.json"
            out.parent.mkdir(parents=True)
            env = {**os.environ, "ATEN_CPU_CAPABILITY": path, "OMP_NUM_THREADS": str(args.threads)}
            cmd = [sys.executable, str(Path(__file__).resolve()), str(Path(args.config).resolve()),
                   "--child", str(out), "--set", *args.overrides]
            results[path] = run_json_child(cmd, out, env, args.timeout)
            print(f"{path}: {json.dumps(results[path])[:300]}", file=sys.stderr, flush=True)
    header = (f"# host spread: {args.config} {' '.join(args.overrides)}\n"
              f"CPU flags: avx2={'avx2' in flags} avx512bw={'avx512bw' in flags}; {args.threads} threads; REPO {REPO}")
    return print_results(header, table(results, flags), results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
