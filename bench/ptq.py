"""Benchmark the ptq_int8 stage on SmolLM2-135M in eager PyTorch: fp32 vs 8da8w vs 8da4w.

Measures, in one run and one process: perplexity (the project's reference method: the first
``--tokens`` + 1 pydoc tokens, non-overlapping 512-token windows, no cache), serialized size
(``torch.save`` of the state dict), prefill latency (128 tokens) and decode speed (greedy,
KV cache), with ``--threads`` threads. Eager torchao int8 is *slower* than fp32 on CPUs without
VNNI (the dynamic quantize/dequantize runs in Python-level ops); the speed of these schemes
comes from the exported ExecuTorch/XNNPACK program, so read the latency columns as the eager
cost only.

    .venv/bin/python bench/ptq.py --tokens 4096 --out /tmp/bench_ptq.txt
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

#: label -> stage options (None = the fp32 baseline)
VARIANTS: dict[str, dict | None] = {
    "fp32": None,
    "8da8w (default: lm_head fp32)": dict(scheme="8da8w"),
    "8da8w all (lm_head int8)": dict(scheme="8da8w", keep_high_precision=[]),
    "8da4w g32 all": dict(scheme="8da4w", group_size=32, keep_high_precision=[]),
    "8da4w g32 lm_head fp32": dict(scheme="8da4w", group_size=32),
    "8da4w g32 lm_head fp32 hqq": dict(scheme="8da4w", group_size=32, weight_qparams="hqq_scale_only"),
}


def serialized_mb(model: torch.nn.Module) -> float:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sd.pt"
        torch.save(model.state_dict(), path)
        return path.stat().st_size / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="perplexity targets (reference: 4096)")
    ap.add_argument("--seq-len", type=int, default=512, help="perplexity window")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=128, help="prompt tokens for the prefill timing")
    ap.add_argument("--decode", type=int, default=16, help="greedy tokens per decode timing run")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median) after one warm-up")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), help="subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--no-latency", action="store_true", help="perplexity and size only")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    from export.decoding.runtime import EagerRunner
    from export.verify import latency, perplexity
    from optimize.stage_api import StageContext, get_stage
    from targets.sources.corpus import load_text, tokenize
    from targets.sources import BundledSource, load_model

    loaded = load_model(BundledSource(name="smollm2-135m"))
    ids = tokenize(load_text("pydoc"), loaded.tokenizer)
    eval_ids = ids[: args.tokens + 1]
    prompt = ids[5000 : 5000 + args.prefill]
    spec = get_stage("ptq_int8")

    rows = []
    lines_out: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines_out.append(line)

    emit(f"# bench/ptq.py  torch {torch.__version__}  threads={args.threads}  cpu_count={os.cpu_count()}")
    emit(f"# perplexity: first {eval_ids.numel()} pydoc ids -> {eval_ids.numel() - 1} targets, windows of {args.seq_len}")
    emit(f"# latency: eager, prefill {args.prefill} tokens, decode {args.decode} tokens, median of {args.runs} after 1 warm-up")
    for label in args.variants:
        opts = VARIANTS[label]
        model = copy.deepcopy(loaded.model)
        details: dict = {}
        t0 = time.perf_counter()
        if opts is not None:
            ctx = StageContext(tokenizer=loaded.tokenizer, calibration=[], train_ids=ids[:0], target=None,
                               work_dir=Path(tempfile.gettempdir()), log=lambda s: None)
            model = spec.fn(model, spec.config_cls(**opts), ctx)
            details = ctx.details
        quant_s = time.perf_counter() - t0
        runner = EagerRunner(model)
        t0 = time.perf_counter()
        ppl = perplexity(runner, eval_ids, args.seq_len)["perplexity"]
        ppl_s = time.perf_counter() - t0
        size = serialized_mb(model)
        lat = {"prefill_ms": float("nan"), "decode_tok_s": float("nan")}
        if not args.no_latency:
            lat = latency(runner, prompt, args.decode, runs=args.runs, warmup=1)
        rows.append(dict(label=label, ppl=ppl, size=size, **{k: lat[k] for k in ("prefill_ms", "decode_tok_s")},
                         quantized=details.get("linear_quantized", 0), kept=details.get("linear_kept", 0)))
        print(f"  [{label}] quantize {quant_s:.1f}s, perplexity pass {ppl_s:.1f}s, ppl {ppl:.3f}", file=sys.stderr,
              flush=True)
        del model, runner

    base = rows[0] if rows and rows[0]["label"] == "fp32" else None
    emit()
    head = f"{'variant':32} {'linear q/kept':>13} {'ppl':>8} {'xppl':>6} {'size MB':>8} {'xsize':>6} " \
           f"{'prefill ms':>10} {'xpre':>6} {'dec tok/s':>9} {'xdec':>6}"
    emit(head)
    emit("-" * len(head))
    for r in rows:
        def ratio(key):
            return r[key] / base[key] if base and base[key] == base[key] and base[key] else float("nan")

        emit(f"{r['label']:32} {str(r['quantized']) + '/' + str(r['kept']):>13} {r['ppl']:8.3f} {ratio('ppl'):6.3f} "
             f"{r['size']:8.1f} {ratio('size'):6.3f} {r['prefill_ms']:10.1f} {ratio('prefill_ms'):6.2f} "
             f"{r['decode_tok_s']:9.2f} {ratio('decode_tok_s'):6.3f}")
    emit()
    emit("# ratios are vs fp32. CPU has 2 cores shared with other jobs: latency figures are noisy.")
    emit("# Eager torchao int8 is slower than fp32 here (no VNNI); exported XNNPACK programs are the fast path.")
    emit("# Sizes are torch.save of the eager state dict: torchao's unpacked_to_int8 layout stores one int4 value")
    emit("# per byte (plus per-group scales), so 8da4w is not smaller than 8da8w here; the XNNPACK .pte packs int4.")
    if args.out:
        args.out.write_text("\n".join(lines_out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
