"""GPTQ's calibration forwards on real SmolLM2-135M weights: stopped after the last target's input
(what ``gptq_model`` does) against every forward run to the end (what it did before), paired.

GPTQ builds each block's Hessians from forward passes of that block over every calibration
window, and the output head's from a forward of the head. A block's forward after its last Linear
(the down projection's product, the residual) and the head's own 49152 x 576 product compute
outputs nothing reads; ``StopAfterLastInput`` ends those forwards once the last target has its
input. This bench times ``GptqRunResult.calibrate_s`` (the feeds alone, not the solves) for both,
round-robin (one run of each per round, so a disturbance on a shared host hits both alike), and
reports each round's ratio and their median; it also checks that both give the same integers and
scales, layer by layer.

The model is SmolLM2's first ``--blocks`` decoder blocks plus its final norm and head (real
weights; the blocks' cost per window is what a full run repeats 30 times), calibrated in float64
as the ``ptq_int8`` stage does, on ``--windows`` windows of 512 tokens of the pydoc text after
the reference evaluation span (``../shared/README.md``).

    .venv/bin/python bench/gptq_calibration.py [--blocks 6] [--windows 8] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch
    from torch import nn

    from optimize.quant import gptq_sequential as gs
    from optimize.quant.fakequant import scheme_for
    from targets.sources.corpus import load_text, split_corpus, tokenize
    from targets.sources import BundledSource, load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(BundledSource(name="smollm2-135m"))
    model = loaded.model.eval()
    model.model.layers = model.model.layers[: args.blocks]
    model.config.num_hidden_layers = args.blocks
    splits = split_corpus(tokenize(load_text("pydoc"), loaded.tokenizer), eval_tokens=4096,
                          calib_tokens=512 * args.windows)
    windows = [splits.calib_ids[i * 512 : (i + 1) * 512] for i in range(args.windows)]
    int4, int8 = scheme_for("8da4w", 32), scheme_for("8da8w", None)
    targets = {n: (int8 if n == "lm_head" else int4) for n, m in model.named_modules()
               if isinstance(m, nn.Linear)}

    real_window = gs.StopAfterLastInput.window

    def run(stopping: bool) -> gs.GptqRunResult:
        gs.StopAfterLastInput.window = real_window if stopping else (lambda self, feed: feed())
        try:
            return gs.gptq_model(copy.deepcopy(model), targets, windows, calibration_dtype=torch.float64)
        finally:
            gs.StopAfterLastInput.window = real_window

    rounds: list[dict[str, float]] = []
    results = {}
    for r in range(args.rounds):
        times = {}
        for label, stopping in (("to the end", False), ("stopped", True)) if r % 2 == 0 else \
                (("stopped", True), ("to the end", False)):
            res = run(stopping)
            times[label] = res.calibrate_s
            results[label] = res
        rounds.append(times)
        print(f"round {r + 1}: to the end {times['to the end']:.1f} s, stopped {times['stopped']:.1f} s, "
              f"ratio {times['stopped'] / times['to the end']:.3f}", flush=True)
    a, b = results["to the end"].layers, results["stopped"].layers
    same = set(a) == set(b) and all(torch.equal(a[n].q, b[n].q) and torch.equal(a[n].scale, b[n].scale) for n in a)
    ratios = [t["stopped"] / t["to the end"] for t in rounds]
    summary = {
        "blocks": args.blocks, "windows": args.windows, "threads": args.threads, "layers": len(a),
        "calibrate_s_to_the_end_median": statistics.median(t["to the end"] for t in rounds),
        "calibrate_s_stopped_median": statistics.median(t["stopped"] for t in rounds),
        "ratio_stopped_over_to_the_end_median": statistics.median(ratios),
        "ratios": ratios, "same_integers_and_scales": same,
    }
    print(f"\nSmolLM2 first {args.blocks} blocks + head, {args.windows} windows x 512 in float64, "
          f"{args.threads} thread(s), {args.rounds} rounds round-robin")
    print("| calibration forwards | median calibrate s | ratio (paired, median) |\n|---|---:|---:|")
    print(f"| to the end (before) | {summary['calibrate_s_to_the_end_median']:.1f} | 1.000 |")
    print(f"| stopped after the last target | {summary['calibrate_s_stopped_median']:.1f} | "
          f"{summary['ratio_stopped_over_to_the_end_median']:.3f} |")
    print(f"same integers and scales in all {len(a)} layers: {same}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
