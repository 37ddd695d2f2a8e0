"""How well the bandwidth model predicts decode speed: one recipe's measured host efficiency predicts
another recipe's host decode rate, next to what that recipe measured (#29's check: within 15%).

Each report must come from a run with a ``device_profile`` (any: its export rows then carry this
host's measured decode rate, bytes per token and copy bandwidth, which is all this reads). Every ordered pair of export rows is
printed: ``predicted`` from the source row's fraction of the ceiling (``optimize.predict.predict_from_another``),
``measured`` the target row's own decode, and their ratio.

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


def export_rows(report: Path) -> list[tuple[str, dict]]:
    data = json.loads(report.read_text())
    out = []
    for row in data["rows"]:
        dev = (row.get("metrics") or {}).get("device")
        if row["kind"].startswith("export") and dev and dev.get("host_fraction_of_ceiling") is not None:
            out.append((f"{report.parent.name} {row['name']}", dev))
    return out


def main(argv=None) -> int:
    from optimize.predict import DevicePrediction, predict_from_another

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=Path("/tmp/bench_predict_decode.json"))
    args = ap.parse_args(argv)
    rows = [r for rep in args.reports for r in export_rows(rep)]
    if len(rows) < 2:
        print("error: need two export rows measured with device_profile: host", file=sys.stderr)
        return 2
    lines = ["| source (its efficiency) | target | source fraction | target bytes/token MiB | predicted tok/s "
             "| measured tok/s | predicted / measured |", "|---|---|---:|---:|---:|---:|---:|"]
    pairs = []
    for sname, s in rows:
        for tname, t in rows:
            if sname == tname:
                continue
            src, dst = DevicePrediction.model_validate(s), DevicePrediction.model_validate(t)
            pred = predict_from_another(src, dst)
            ratio = pred / dst.host_decode_tok_s if pred and dst.host_decode_tok_s else None
            pairs.append({"source": sname, "target": tname, "predicted": pred, "measured": dst.host_decode_tok_s,
                          "ratio": ratio})
            bpt = (dst.weight_bytes_per_token + (dst.kv_bytes_per_token or 0)) / 2**20
            lines.append(f"| {sname} | {tname} | {src.host_fraction_of_ceiling:.3f} | {bpt:.1f} | {pred:.1f} | "
                         f"{dst.host_decode_tok_s:.1f} | {ratio:.3f} |")
    return print_results("decode predicted from another recipe's host efficiency (bandwidth model)",
                         "\n".join(lines), {"pairs": pairs}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
