"""Accuracy of the shipped artifacts on SmolLM2-135M: plain round-to-nearest vs our methods.

One run, one table: scheme, runtime, perplexity, Δ% vs fp32, top-1 agreement with fp32,
size, decode tok/s and prefill ms. Every quantized row is measured in the runtime that
ships it (ExecuTorch/XNNPACK .pte, ONNX Runtime CPU), through the same Runner interface and
``optimize.checks.accuracy.evaluate`` the pipeline uses. Text: the project's reference
(first 4097 pydoc tokens, 512-token windows, no cache between windows); calibration comes
from the span right after it (never evaluated). The model is prepared with the real stages
(smoothquant, awq, ptq_int8), so the bench measures the code users run.

Exports are cached under ``--work-dir`` by row, so a re-run only measures. ``--quick``
keeps five rows and 1024 tokens.

    .venv/bin/python bench/accuracy.py [--quick] [--rows a,b] [--out /tmp/bench_accuracy.txt]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# as a script this folder would shadow the real ``executorch`` package with bench/executorch.py
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402

THREADS = 2
PROMPT, DECODE = 128, 32


@dataclass
class Row:
    name: str
    runtime: str  # eager | executorch | onnxruntime
    stages: list[dict] = field(default_factory=list)
    export: dict = field(default_factory=dict)
    note: str = ""


ROWS = [
    Row("fp32", "eager"),
    Row("8da4w g32 RTN, lm_head fp32", "executorch",
        [{"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32}], {"quantize": "none", "max_seq_len": 512},
        "plain round-to-nearest (the peer's recipe, lm_head kept)"),
    Row("8da4w g32 AWQ+HQQ, lm_head fp32", "executorch",
        [{"kind": "awq", "scheme": "8da4w", "weight_qparams": "hqq_scale_only"},
         {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32, "weight_qparams": "hqq_scale_only"}],
        {"quantize": "none", "max_seq_len": 512}, "AWQ scales folded into norms + HQQ scale search"),
    Row("8da4w g32 AWQ, lm_head fp32", "executorch",
        [{"kind": "awq", "scheme": "8da4w"}, {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32}],
        {"quantize": "none", "max_seq_len": 512}, "AWQ scales folded into norms, then round-to-nearest"),
    Row("8da4w g32 HQQ, lm_head fp32", "executorch",
        [{"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32, "weight_qparams": "hqq_scale_only"}],
        {"quantize": "none", "max_seq_len": 512}),
    Row("8da8w", "executorch", [{"kind": "ptq_int8", "scheme": "8da8w"}], {"quantize": "none", "max_seq_len": 512}),
    Row("int8 dynamic RTN (weight MatMuls)", "onnxruntime", [], {"quantize": "dynamic"},
        "plain ORT dynamic int8; lm_head, embedding, attention matmuls fp32"),
    Row("int8 dynamic + SmoothQuant", "onnxruntime", [{"kind": "smoothquant", "alpha": 0.5}], {"quantize": "dynamic"},
        "ORT dynamic quantizes each activation per tensor: outliers are what SmoothQuant removes"),
    Row("int8 static QDQ", "onnxruntime", [], {"quantize": "static"}, "plain static, minmax"),
    Row("int8 static QDQ + SmoothQuant", "onnxruntime", [{"kind": "smoothquant", "alpha": 0.5}],
        {"quantize": "static"}),
    Row("int8 static QDQ + SmoothQuant, emb+head int8", "onnxruntime", [{"kind": "smoothquant", "alpha": 0.5}],
        {"quantize": "static", "quantize_lm_head": True, "quantize_embedding": True}, "the size-goal configuration"),
]
QUICK = ["fp32", "8da4w g32 AWQ, lm_head fp32", "8da4w g32 RTN, lm_head fp32",
         "int8 dynamic + SmoothQuant", "int8 dynamic RTN (weight MatMuls)"]


def _prepare(model, row: Row, calib, tokenizer, work: Path, log):
    """Run the row's stages exactly as the pipeline would."""
    from optimize.config import load_config
    from optimize.stage_api import StageContext, get_stage

    if not row.stages:
        return model, {}
    cfg = load_config({"version": 1, "model": {"source": "bundled", "name": "smollm2-135m"}, "stages": row.stages},
                      check_files=False)
    details = {}
    for st in cfg.stages:
        ctx = StageContext(tokenizer=tokenizer, calibration=calib, train_ids=torch.zeros(0, dtype=torch.long),
                           target=None, work_dir=work, log=log)
        t0 = time.perf_counter()
        model = get_stage(st.kind).fn(model, st, ctx)
        details[st.kind] = {**ctx.details, "wall_s": round(time.perf_counter() - t0, 1)}
    return model, details


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")[:60]


def measure_row(row: Row, base_model, tokenizer, windows, baseline, calib, prompt, work: Path, log) -> dict:
    from export.atomic import atomic_write_json
    from export.base import get_exporter
    from export.runtime import EagerRunner
    from export.verify import latency
    from optimize.checks.accuracy import evaluate

    t0 = time.perf_counter()
    out = work / _slug(row.name)
    details: dict = {}
    if row.runtime == "eager":
        runner = EagerRunner(base_model)
        size = sum(p.numel() * p.element_size() for p in {id(p): p for p in base_model.parameters()}.values())
    else:
        exporter = get_exporter(row.runtime)
        manifest = out / "manifest.json"
        if not manifest.exists():
            model, details = _prepare(copy.deepcopy(base_model), row, calib, tokenizer, work, log)
            atomic_write_json(out / "prepare.json", details)
            exporter.export(model, tokenizer, out, row.export, calibration=calib, log=log)
            del model
        info = json.loads(manifest.read_text())
        size = info.get("size_bytes") or 0
        artifact = out / info.get("artifact", "model.onnx" if row.runtime == "onnxruntime" else "model.pte")
        runner = exporter.load(artifact, threads=THREADS) if row.runtime == "executorch" else exporter.load(artifact)
    acc = evaluate(runner, windows, baseline, desc=row.name)
    lat = latency(runner, prompt, DECODE, runs=3, warmup=1)
    return {"name": row.name, "runtime": row.runtime, "perplexity": acc.perplexity, "top1": acc.top1_agreement,
            "kl": acc.kl_divergence, "tokens": acc.tokens, "size_mb": size / 1e6, "decode_tok_s": lat["decode_tok_s"],
            "prefill_ms": lat["prefill_ms"], "note": row.note, "details": details, "wall_s": time.perf_counter() - t0}


def table(results: list[dict], fp32_ppl: float, fp32_size: float) -> str:
    lines = ["| scheme | runtime | ppl | Δ% vs fp32 | top-1 | KL | size MB (x fp32) | decode tok/s | prefill-128 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['runtime']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['runtime']} | {r['perplexity']:.2f} | {100 * (r['perplexity'] / fp32_ppl - 1):+.1f} | "
            f"{r['top1']:.3f} | {r['kl']:.4f} | {r['size_mb']:.0f} ({r['size_mb'] / fp32_size:.2f}x) | "
            f"{r['decode_tok_s']:.1f} | {r['prefill_ms']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="five rows, 1024 evaluation tokens")
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: all, or the quick set)")
    ap.add_argument("--tokens", type=int, default=None, help="evaluation tokens (default 4096, quick 1024)")
    ap.add_argument("--work-dir", default="/tmp/bench_accuracy", help="export cache")
    ap.add_argument("--out", default="/tmp/bench_accuracy.txt", help="where the table (and JSON) is written")
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)

    from export.atomic import atomic_write_json, atomic_write_text
    from export.runtime import EagerRunner
    from optimize.checks.accuracy import BaselineLogits, eval_windows, evaluate
    from train.corpus import load_text, split_corpus, tokenize
    from train.corpus import windows as cut
    from train.sources import BundledSource, load_model

    names = args.rows.split(",") if args.rows else (QUICK if args.quick else [r.name for r in ROWS])
    unknown = [n for n in names if n not in {r.name for r in ROWS}]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {[r.name for r in ROWS]}")
    rows = sorted((r for r in ROWS if r.name in names), key=lambda r: names.index(r.name))  # the order asked
    n_tokens = args.tokens or (1024 if args.quick else 4096)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    loaded = load_model(BundledSource(name="smollm2-135m"))
    model, tok = loaded.model.eval(), loaded.tokenizer
    ids = tokenize(load_text("pydoc"), tok)
    splits = split_corpus(ids, eval_tokens=4096, calib_tokens=4096)  # eval span is always the reference 4097
    windows = eval_windows(splits.eval_ids[: n_tokens + 1], 512)
    calib = cut(splits.calib_ids, 512, max_windows=8)
    prompt = splits.train_ids[:PROMPT]
    baseline = BaselineLogits()
    with torch.no_grad():
        fp32 = evaluate(EagerRunner(model), windows, keep=baseline, desc="fp32 baseline")
    fp32_size = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values()) / 1e6
    log(f"fp32 eager perplexity {fp32.perplexity:.3f} on {fp32.tokens} tokens")

    results = []
    t_all = time.perf_counter()
    for row in rows:
        log(f"row {row.name} ({row.runtime})")
        try:
            with torch.no_grad():
                r = measure_row(row, model, tok, windows, baseline, calib, prompt, work, log)
        except Exception as exc:  # one failing runtime must not lose the other rows
            r = {"name": row.name, "runtime": row.runtime, "error": f"{type(exc).__name__}: {exc}"}
        results.append(r)
        log(json.dumps({k: v for k, v in r.items() if k != "details"}, default=str))
        text = (f"bench/accuracy.py — SmolLM2-135M, {fp32.tokens} tokens of pydoc (first {fp32.tokens + 1} ids, "
                f"512-token windows), {THREADS} threads; latency: prefill {PROMPT} tokens, decode {DECODE}, median of 3\n\n"
                + table(results, fp32.perplexity, fp32_size) + f"\n\nwall {time.perf_counter() - t_all:.0f} s\n")
        atomic_write_text(args.out, text)
        atomic_write_json(Path(args.out).with_suffix(".json"), results)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
