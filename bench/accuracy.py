"""Accuracy of the shipped artifacts on SmolLM2-135M: plain round-to-nearest vs our methods.

One run, one table: scheme, runtime, perplexity, Δ% vs fp32, top-1 agreement with fp32,
size, decode tok/s and prefill ms. Every quantized row is measured in the runtime that
ships it (ExecuTorch/XNNPACK .pte, ONNX Runtime CPU), through the same Runner interface and
``optimize.checks.accuracy.evaluate`` the pipeline uses. Text: the project's reference
(first 4097 pydoc tokens, 512-token windows, no cache between windows); calibration comes
from the span right after it (never evaluated). The model is prepared with the real stages
(smoothquant, awq, ptq_int8), so the bench measures the code users run.

Exports are cached under ``--work-dir`` by row, so a re-run only measures. ``--quick``
keeps five rows and 1024 tokens. ``--ab`` runs the GPTQ A/B rows instead (eager perplexity of the
quantized model, one GPTQ option changed per row against the AWQ+GPTQ base; the export does not
depend on these options, so eager isolates them; no latency).

    .venv/bin/python bench/accuracy.py [--quick | --ab] [--rows "a;b"] [--out /tmp/bench_accuracy.txt]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402

from bench.common import failed_row  # noqa: E402

THREADS = 2
PROMPT, DECODE = 128, 32


@dataclass
class Row:
    name: str
    runtime: str  # eager | executorch | onnxruntime
    stages: list[dict] = field(default_factory=list)
    export: dict = field(default_factory=dict)
    note: str = ""
    #: calibration windows (512 tokens each) the row's stages receive; GPTQ reads at most its own
    #: calibration_windows of them, AWQ its 4
    calib_windows: int = 8
    #: measure prefill/decode latency (off for the eager A/B rows: eager torchao is not what ships)
    latency: bool = True


ET = {"quantize": "none", "max_seq_len": 512}
GPTQ = {"algorithm": "gptq", "gptq": {"scale_init": "mse", "calibration_windows": 8}}
AWQ = {"kind": "awq", "scheme": "8da4w", "keep_high_precision": []}
PLAIN_4BIT = "8da4w g32 RTN, all Linear (plain)"
ROWS = [
    Row("fp32", "eager"),
    # ---- ExecuTorch / XNNPACK, 4-bit weights
    Row(PLAIN_4BIT, "executorch", [{"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": []}], ET,
        "the peer's recipe (optimum-executorch 8da4w): every Linear int4 round-to-nearest; the decode baseline"),
    Row("8da4w g32 RTN, lm_head fp32", "executorch", [{"kind": "ptq_int8", "scheme": "8da4w"}], ET,
        "round-to-nearest with the most sensitive layer kept fp32"),
    Row("8da4w g32 GPTQ, all Linear", "executorch",
        [{"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], **GPTQ}], ET,
        "GPTQ alone (act-order, MSE-clipped static group scales): same layout and bytes as the plain row"),
    Row("8da4w g32 AWQ+GPTQ, all Linear", "executorch",
        [AWQ, {"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], **GPTQ}], ET,
        "AWQ scales folded into the norms, then GPTQ: same layout and bytes as the plain row"),
    Row("8da4w g32 AWQ+GPTQ, lm_head 8da8w", "executorch",
        [AWQ, {"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], "int8_modules": ["lm_head"], **GPTQ}],
        ET, "the output projection int8, listed by hand"),
    Row("8da4w g32 AWQ+GPTQ, budget decode +10%", "executorch",
        [AWQ, {"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], "max_decode_slowdown_pct": 10, **GPTQ}],
        ET, "sensitive groups promoted to 8da8w automatically while the estimated decode cost stays within +10%"),
    # ---- the source's own 4-bit grid (the bundled model is a GGUF Q4_1 conversion): issue 28's recipes
    Row("8da4w g32 source grid, lm_head 8da8w", "executorch",
        [{"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], "int8_modules": ["lm_head"],
          "source_grid": True}], ET,
        "the 210 decoder Linears keep the GGUF's Q4_1 grid exactly (int4 + per-group offset path); lm_head RTN int8"),
    Row("8da4w g32 source grid, all Linear (lm_head GPTQ)", "executorch",
        [{"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], "source_grid": True,
          "algorithm": "gptq", "gptq": {"scale_init": "output_mse", "calibration_windows": 32}}], ET,
        "all-4-bit: the grid kept, the lm_head (8-bit in the GGUF) GPTQ'd to int4", calib_windows=32),
    Row("ORT int4 source grid, all Linear, tied embedding", "onnxruntime",
        [{"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], "source_grid": True,
          "algorithm": "gptq", "gptq": {"scale_init": "output_mse", "calibration_windows": 32},
          "quantize_embedding": "tied"}], {"accuracy_level": 4},
        "examples/smollm2_onnx_int4.yaml: MatMulNBits + offset MatMul on the group sums; table shared", calib_windows=32),
    # ---- ExecuTorch, 8-bit
    Row("8da8w RTN, lm_head fp32", "executorch", [{"kind": "ptq_int8", "scheme": "8da8w"}], ET),
    # ---- ONNX Runtime, W8A8
    Row("ORT int8 dynamic (ORT quantizer)", "onnxruntime", [], {"quantize": "dynamic"},
        "plain ORT dynamic int8 on the weight MatMuls; lm_head, embedding, attention fp32"),
    Row("ORT int8 static QDQ minmax", "onnxruntime", [], {"quantize": "static"}, "plain static, minmax calibration"),
    Row("ORT int8 static QDQ percentile + SmoothQuant 0.7", "onnxruntime", [{"kind": "smoothquant", "alpha": 0.7}],
        {"quantize": "static", "calibrate_method": "percentile"}, "calibrated per-tensor ranges, clipped at the 99.999th percentile"),
    Row("ORT int8 dynamic + SmoothQuant 0.7", "onnxruntime", [{"kind": "smoothquant", "alpha": 0.7}],
        {"quantize": "dynamic"}, "per-tensor activations: SmoothQuant moves the channel outliers into the weights"),
    Row("ORT W8A8 per-token + SmoothQuant 0.5", "onnxruntime", [{"kind": "smoothquant", "alpha": 0.5}],
        {"quantize": "dynamic_per_token"}, "one activation scale per token (8da8w arithmetic in standard ONNX ops)"),
    Row("ORT W8A8 per-token + SmoothQuant 0.5, head+emb int8", "onnxruntime", [{"kind": "smoothquant", "alpha": 0.5}],
        {"quantize": "dynamic_per_token", "quantize_lm_head": True, "quantize_embedding": True},
        "the size-goal configuration: every weight int8"),
]


def _ab(name: str, note: str, calib_windows: int = 8, **gptq) -> Row:
    """One GPTQ option changed against the A/B base (AWQ, then all-Linear 8da4w g32 GPTQ with mse scales,
    act_order, damp 0.01, 8 windows), measured eager."""
    opts = {"scale_init": "mse", "act_order": True, "damp": 0.01, "calibration_windows": 8, **gptq}
    return Row(f"A/B GPTQ {name}", "eager",
               [AWQ, {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32, "keep_high_precision": [],
                      "algorithm": "gptq", "gptq": opts}], note=note, calib_windows=calib_windows, latency=False)


#: the GPTQ options one at a time (issue 28): eager perplexity of AWQ + all-Linear 8da4w g32 GPTQ
AB_ROWS = [
    _ab("base (mse, act_order, damp 0.01, 8 win)", "the shipped GPTQ defaults after AWQ"),
    _ab("act_order off", "columns in input order", act_order=False),
    _ab("scale_init absmax", "max|w| group scales", scale_init="absmax"),
    _ab("scale_init output_mse", "clip search on the diag(H)-weighted output error", scale_init="output_mse"),
    _ab("damp auto", "damping chosen per layer from 0.001..0.1", damp="auto"),
    _ab("32 windows", "32 calibration windows instead of 8", calib_windows=32, calibration_windows=32),
    _ab("output_mse + damp auto", "both new options", scale_init="output_mse", damp="auto"),
    _ab("output_mse + 32 windows", "output_mse with the demo's 32 windows", calib_windows=32,
        scale_init="output_mse", calibration_windows=32),
]
ROWS += AB_ROWS
QUICK = ["fp32", PLAIN_4BIT, "8da4w g32 AWQ+GPTQ, all Linear", "ORT int8 dynamic (ORT quantizer)",
         "ORT W8A8 per-token + SmoothQuant 0.5, head+emb int8"]


#: the model after a row's first stage, for later rows that start with the same stage on the same
#: calibration (the A/B rows all fold the same AWQ first): key -> (model, details)
_FIRST_STAGE: dict[str, tuple] = {}


def _prepare(model, row: Row, calib, tokenizer, work: Path, log):
    """Run the row's stages exactly as the pipeline would."""
    from optimize.config import load_config
    from optimize.stage_api import StageContext, get_stage

    if not row.stages:
        return model, {}
    cfg = load_config({"version": 1, "model": {"source": "bundled", "name": "smollm2-135m"}, "stages": row.stages},
                      check_files=False)
    details = {}
    stages = list(cfg.stages)
    key = json.dumps([row.stages[0], len(calib)], sort_keys=True) if len(stages) > 1 else None
    if key in _FIRST_STAGE:
        cached, first = _FIRST_STAGE[key]
        model, details = copy.deepcopy(cached), {stages[0].kind: {**first, "reused": True}}
        stages = stages[1:]
    for i, st in enumerate(stages):
        ctx = StageContext(tokenizer=tokenizer, calibration=calib, train_ids=torch.zeros(0, dtype=torch.long),
                           target=None, work_dir=work, log=log)
        t0 = time.perf_counter()
        model = get_stage(st.kind).fn(model, st, ctx)
        details[st.kind] = {**ctx.details, "wall_s": round(time.perf_counter() - t0, 1)}
        if i == 0 and key is not None and key not in _FIRST_STAGE:
            _FIRST_STAGE.clear()  # one model kept at a time
            _FIRST_STAGE[key] = (copy.deepcopy(model), details[st.kind])
    return model, details


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")[:60]


def measure_row(row: Row, base_model, tokenizer, windows, baseline, calib, prompt, work: Path, log,
                prev: dict | None = None) -> dict:
    """Export (unless cached), then accuracy through the runtime and latency. ``prev`` (a row of an
    earlier run's JSON) supplies the accuracy figures, so only latency is measured again."""
    from targets.atomic import atomic_write_json
    from export.base import get_exporter
    from export.decoding.runtime import EagerRunner
    from export.verify import latency
    from optimize.checks.accuracy import evaluate

    t0 = time.perf_counter()
    out = work / _slug(row.name)
    details: dict = {}
    calib = calib[: row.calib_windows]
    if row.runtime == "eager":
        model = base_model
        if row.stages:  # eager perplexity of the prepared (quantized) model; nothing cached
            model, details = _prepare(copy.deepcopy(base_model), row, calib, tokenizer, work, log)
        runner = EagerRunner(model)
        # an eager quantized model holds int4 values in int8 storage and an untied head: not what ships
        size = None if row.stages else sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
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
    if prev is not None and prev.get("tokens") == sum(int(w.numel()) - 1 for w in windows):
        acc = {k: prev[k] for k in ("perplexity", "top1", "kl", "tokens")}
    else:
        r = evaluate(runner, windows, baseline, desc=row.name)
        acc = {"perplexity": r.perplexity, "top1": r.top1_agreement, "kl": r.kl_divergence, "tokens": r.tokens}
    lat = latency(runner, prompt, DECODE, runs=5, warmup=1) if row.latency else {"decode_tok_s": None, "prefill_ms": None}
    if (out / "prepare.json").exists() and not details:
        details = json.loads((out / "prepare.json").read_text())
    return {"name": row.name, "runtime": row.runtime, **acc, "size_mb": None if size is None else size / 1e6, "decode_tok_s": lat["decode_tok_s"],
            "prefill_ms": lat["prefill_ms"], "note": row.note, "details": details, "wall_s": time.perf_counter() - t0}


def table(results: list[dict], fp32_ppl: float, fp32_size: float) -> str:
    """Ratios: size against fp32; decode against the plain 8da4w .pte and prefill against fp32 eager,
    both measured in this run."""
    ok = {r["name"]: r for r in results if "error" not in r}
    plain_dec = ok.get(PLAIN_4BIT, {}).get("decode_tok_s")
    fp32_pf = ok.get("fp32", {}).get("prefill_ms")
    lines = ["| scheme | runtime | ppl | Δ% vs fp32 | top-1 | KL | size MB (x fp32) | decode tok/s (x plain 8da4w) "
             "| prefill-128 ms (x fp32) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(failed_row(f"{r['name']} | {r['runtime']}", r["error"], 6, width=120))
            continue
        size = "–" if r["size_mb"] is None else f"{r['size_mb']:.0f} ({r['size_mb'] / fp32_size:.2f}x)"
        dec = "–" if r["decode_tok_s"] is None else (
            f"{r['decode_tok_s']:.1f}" + (f" ({r['decode_tok_s'] / plain_dec:.2f}x)" if plain_dec else ""))
        pf = "–" if r["prefill_ms"] is None else (
            f"{r['prefill_ms']:.0f}" + (f" ({r['prefill_ms'] / fp32_pf:.2f}x)" if fp32_pf else ""))
        lines.append(
            f"| {r['name']} | {r['runtime']} | {r['perplexity']:.2f} | {100 * (r['perplexity'] / fp32_ppl - 1):+.1f} | "
            f"{r['top1']:.3f} | {r['kl']:.4f} | {size} | {dec} | {pf} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="five rows, 1024 evaluation tokens")
    ap.add_argument("--ab", action="store_true", help="the GPTQ A/B rows (eager, one option per row) and fp32")
    ap.add_argument("--rows", default=None, help="row names separated by ';' (default: all, or the quick set)")
    ap.add_argument("--tokens", type=int, default=None, help="evaluation tokens (default 4096, quick 1024)")
    ap.add_argument("--work-dir", default="/tmp/bench_accuracy", help="export cache")
    ap.add_argument("--out", default="/tmp/bench_accuracy.txt", help="where the table (and JSON) is written")
    ap.add_argument("--reuse-accuracy", default=None,
                    help="JSON of an earlier run: its rows keep their accuracy figures and only latency is re-measured "
                    "(for a quiet-machine latency pass over cached exports)")
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)

    from targets.atomic import atomic_write_json, atomic_write_text
    from export.decoding.runtime import EagerRunner
    from optimize.checks.accuracy import BaselineLogits, eval_windows, evaluate
    from targets.sources.corpus import load_text, split_corpus, tokenize
    from targets.sources.corpus import windows as cut
    from targets.sources import BundledSource, load_model

    names = [n.strip() for n in args.rows.split(";") if n.strip()] if args.rows else (
        QUICK if args.quick else ["fp32"] + [r.name for r in AB_ROWS] if args.ab
        else [r.name for r in ROWS if r not in AB_ROWS])
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
    calib_n = max(r.calib_windows for r in rows)  # the first 8 windows are the same whatever the count
    splits = split_corpus(ids, eval_tokens=4096, calib_tokens=512 * calib_n)  # eval span is always the reference 4097
    windows = eval_windows(splits.eval_ids[: n_tokens + 1], 512)
    calib = cut(splits.calib_ids, 512, max_windows=calib_n)
    prompt = ids[5000 : 5000 + PROMPT]  # the shared reference's prompt offset
    baseline = BaselineLogits()
    with torch.no_grad():
        fp32 = evaluate(EagerRunner(model), windows, keep=baseline, desc="fp32 baseline")
    fp32_size = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values()) / 1e6
    log(f"fp32 eager perplexity {fp32.perplexity:.3f} on {fp32.tokens} tokens")

    prev_rows = {}
    if args.reuse_accuracy:
        prev_rows = {r["name"]: r for r in json.loads(Path(args.reuse_accuracy).read_text()) if "error" not in r}
    results = []
    t_all = time.perf_counter()
    for row in rows:
        log(f"row {row.name} ({row.runtime})")
        try:
            with torch.no_grad():
                r = measure_row(row, model, tok, windows, baseline, calib, prompt, work, log, prev_rows.get(row.name))
        except Exception as exc:  # one failing runtime must not lose the other rows
            r = {"name": row.name, "runtime": row.runtime, "error": f"{type(exc).__name__}: {exc}"}
        results.append(r)
        log(json.dumps({k: v for k, v in r.items() if k != "details"}, default=str))
        text = (f"bench/accuracy.py — SmolLM2-135M, {fp32.tokens} tokens of pydoc (first {fp32.tokens + 1} ids, "
                f"512-token windows), {THREADS} threads; latency: prefill {PROMPT} tokens, decode {DECODE}, median of 5\n\n"
                + table(results, fp32.perplexity, fp32_size) + f"\n\nwall {time.perf_counter() - t_all:.0f} s\n")
        atomic_write_text(args.out, text)
        atomic_write_json(Path(args.out).with_suffix(".json"), results)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
