"""How well the bandwidth model predicts decode speed across recipes: one recipe's measured host
efficiency (the fraction of the copy-bandwidth ceiling its decode reaches) predicts another recipe's
host decode rate, next to what that recipe measured (#29's check: within 15%).

Each report must come from a run with a ``device_profile`` (any: its export rows then carry this
host's measured decode rate, bytes per token and copy bandwidth). Every ordered pair of export rows
is printed. ``--rounds N`` (default 5) measures every row's ``.pte`` again here, round-robin, with the
report's latency settings, and uses the medians: runs made hours apart on a shared host differ by
more than the model does (the same ``.pte`` measured 167 and 193 tok/s in two pipeline runs).

    optimize pipeline examples/smollm2.yaml --target executorch --device-profile host
    optimize fit examples/smollm2.yaml --device-profile raspberry-pi-5 --output /tmp/fit   # an 8da8w winner
    optimize pipeline /tmp/fit/fit.yaml --output runs/fit-pi5
    .venv/bin/python bench/predict_decode.py runs/smollm2-executorch/report.json runs/fit-pi5/report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import print_results  # noqa: E402


def export_rows(report: Path) -> list[tuple[str, dict, dict]]:
    """(name, device prediction, run facts) of each export row measured with a device profile; a
    report from before ``weight_bytes_by_scheme`` existed gets it from its config and graph record."""
    from optimize.config import _pipeline_model
    from optimize.footprint.predict import bytes_by_scheme
    from targets.sources import peek_config

    data = json.loads(report.read_text())
    cfg = _pipeline_model().model_validate(data["config"])
    config = peek_config(cfg.model)
    out = []
    for row in data["rows"]:
        dev = (row.get("metrics") or {}).get("device")
        if row["kind"].startswith("export") and dev and dev.get("host_fraction_of_ceiling") is not None:
            if dev.get("weight_bytes_by_scheme") is None:
                dev["weight_bytes_by_scheme"] = bytes_by_scheme(config, row.get("details") or {})
            facts = {"artifact": row.get("artifact"), "latency": cfg.checks.latency.model_dump()}
            out.append((f"{report.parent.name} {row['name']}", dev, facts))
    return out


def remeasure(rows: list, rounds: int) -> None:
    """Each row's decode rate measured again in this process, round-robin over ``rounds`` rounds
    (each the report's prompt, decode length and threads); the median replaces the report's."""
    import statistics

    import torch

    from export.executorch.runner import ExecuTorchRunner
    from optimize.checks.latency import measure_latency

    runners = [ExecuTorchRunner(f["artifact"]) for _, _, f in rows]
    prompt = torch.randint(100, 40000, (rows[0][2]["latency"]["prompt_tokens"],), generator=torch.Generator().manual_seed(0))
    rates: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for i, ((_, _, f), runner) in enumerate(zip(rows, runners)):
            lat = f["latency"]
            res = measure_latency(runner, prompt, lat["decode_tokens"], runs=lat["runs"], warmup=1, threads=lat["threads"])
            rates[i].append(res["decode_tok_s"])
    for (_, dev, _), r in zip(rows, rates):  # the fraction of the ceiling scales with the rate
        new = statistics.median(r)
        dev["host_fraction_of_ceiling"] *= new / dev["host_decode_tok_s"]
        dev["host_decode_tok_s"] = new


def main(argv=None) -> int:
    from optimize.footprint.predict import DevicePrediction, nearest_source, precision_overlap, predict_from_another

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=Path("/tmp/bench_predict_decode.json"))
    ap.add_argument("--rounds", type=int, default=5, help="rounds of measuring every .pte here (0: the reports' own)")
    args = ap.parse_args(argv)
    rows = [r for rep in args.reports for r in export_rows(rep)]
    if len(rows) < 2:
        print("error: need two export rows measured with device_profile: host", file=sys.stderr)
        return 2
    if args.rounds:
        remeasure(rows, args.rounds)
    lines = ["| source | target | source fraction | target MiB/token (fp32 / 8da8w / 8da4w, + KV) | predicted tok/s "
             "| measured tok/s | predicted / measured |", "|---|---|---:|---|---:|---:|---:|"]
    pairs = []
    for sname, s, _ in rows:
        for tname, t, _ in rows:
            if sname == tname:
                continue
            src, dst = DevicePrediction.model_validate(s), DevicePrediction.model_validate(t)
            pred, measured = predict_from_another(src, dst), dst.host_decode_tok_s
            ratio = pred / measured if pred and measured else None
            pairs.append({"source": sname, "target": tname, "predicted": pred, "measured": measured, "ratio": ratio})
            mib = " / ".join(f"{(dst.weight_bytes_by_scheme or {}).get(k, 0) / 2**20:.0f}"
                             for k in ("fp32", "8da8w", "8da4w"))
            lines.append(f"| {sname} | {tname} | {src.host_fraction_of_ceiling:.3f} | {mib}, + "
                         f"{(dst.kv_bytes_per_token or 0) / 2**20:.1f} | {pred:.1f} | {measured:.1f} | {ratio:.3f} |")
    # what a user with several measured recipes does: predict from the one whose precisions are most alike
    near = ["", "Each target predicted from its nearest source (optimize.footprint.predict.nearest_source: the most alike "
            "precision mix):", "", "| target | nearest source | precision overlap | predicted tok/s | measured tok/s "
            "| predicted / measured |", "|---|---|---:|---:|---:|---:|"]
    nearest = []
    preds = {name: DevicePrediction.model_validate(d) for name, d, _ in rows}
    for tname, dst in preds.items():
        others = {n: p for n, p in preds.items() if n != tname}
        src = nearest_source(dst, list(others.values()))
        sname = next(n for n, p in others.items() if p is src)
        pair = next(p for p in pairs if p["source"] == sname and p["target"] == tname)
        nearest.append({**pair, "overlap": precision_overlap(src, dst)})
        near.append(f"| {tname} | {sname} | {precision_overlap(src, dst):.2f} | {pair['predicted']:.1f} | "
                    f"{pair['measured']:.1f} | {pair['ratio']:.3f} |")

    def worst(ps):
        return max(abs(p["ratio"] - 1) for p in ps if p["ratio"]) * 100

    near += ["", f"worst |predicted / measured - 1|: every pair {worst(pairs):.1f}%, nearest source {worst(nearest):.1f}%"]
    where = f"measured here, median of {args.rounds} round-robin rounds" if args.rounds else "the reports' own"
    return print_results(f"decode predicted from another recipe's host efficiency (bandwidth model; decode rates: "
                         f"{where})", "\n".join(lines + near), {"pairs": pairs, "nearest": nearest,
                                                                "rounds": args.rounds}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
