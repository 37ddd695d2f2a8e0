"""Benchmark the ONNX Runtime target on SmolLM2-135M: eager fp32 vs ORT fp32 / dynamic / static int8.

Uses the project's reference measurement (shared notes): first 4097 pydoc tokens, 512-token
windows, summed NLL; prompts from offset 5000; 2 threads; median of ``--runs`` after a warm-up.
All runtimes are measured with the same :mod:`export.verify` functions.

``--with-optimum`` builds a separate venv with optimum-onnx (it needs transformers<4.58, so it is
never imported here), exports the same weights with ``optimum-cli export onnx --task
text-generation-with-past`` and ORTQuantizer's dynamic avx2 defaults, then measures both of its
models with our ORT runner (its graph has the same input/output names).

    OMP_NUM_THREADS=2 .venv/bin/python bench/onnxruntime.py --output /tmp/bench_onnxruntime.txt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, this file's folder is sys.path[0], and its name would shadow the real
# onnxruntime package: drop that folder before anything imports onnxruntime.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

GOALS = "int8 prefill <= 0.5x ORT fp32, file <= 0.3x, perplexity within 2% (static) / 3% (dynamic) of fp32"


def measure(runner, eval_ids, prompt_ids, runs: int, decode_tokens: int) -> dict:
    from export.verify import latency, perplexity

    t = time.perf_counter()
    ppl = perplexity(runner, eval_ids, 512)["perplexity"]
    ppl_s = time.perf_counter() - t
    p128 = latency(runner, prompt_ids[:128], decode_tokens, runs=runs)
    p512 = latency(runner, prompt_ids[:512], 1, runs=runs)
    return {"ppl": ppl, "ppl_s": ppl_s, "prefill128_ms": p128["prefill_ms"], "prefill512_ms": p512["prefill_ms"],
            "decode_tok_s": p128["decode_tok_s"], "size_mb": (runner.size_bytes() or 0) / 1e6}


def optimum_venv(venv: Path, log) -> Path:
    """A venv of its own for optimum-onnx (transformers<4.58 conflicts with ours)."""
    py = venv / "bin" / "python"
    if not (venv / ".ok").exists():
        log(f"building optimum-onnx venv at {venv} (one time)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "optimum-onnx[onnxruntime]==0.1.0", "transformers<4.58",
                        "torch==2.13.0", "onnxruntime==1.31.1"], check=True)
        (venv / ".ok").touch()
    return py


OPTIMUM_SCRIPT = r"""
import sys, time, json
from pathlib import Path
hf, out = Path(sys.argv[1]), Path(sys.argv[2])
t = time.time()
from optimum.exporters.onnx import main_export
main_export(str(hf), output=str(out / "fp32"), task="text-generation-with-past", device="cpu", no_post_process=False)
t_export = time.time() - t
from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig
t = time.time()
q = ORTQuantizer.from_pretrained(str(out / "fp32"), file_name="model.onnx")
q.quantize(save_dir=str(out / "int8"), quantization_config=AutoQuantizationConfig.avx2(is_static=False, per_channel=True),
           use_external_data_format=True)
print("OPTIMUM_TIMES " + json.dumps({"export_s": t_export, "quantize_s": time.time() - t}))
"""


def run_optimum(lm, work: Path, log, args_reuse: bool = False) -> dict[str, Path]:
    hf = work / "smollm2-hf"
    if not (hf / "config.json").exists():
        lm.model.save_pretrained(hf)
        lm.tokenizer.save_pretrained(hf)
        # Old transformers read rope_theta, not v5's rope_parameters (shared notes): write both.
        cfg = json.loads((hf / "config.json").read_text())
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta")
        if theta:
            cfg["rope_theta"] = theta
        cfg.pop("dtype", None)
        cfg["torch_dtype"] = "float32"
        (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    py = optimum_venv(work / "optimum-venv", log)
    script = work / "optimum_export.py"
    script.write_text(OPTIMUM_SCRIPT)
    out = work / "optimum"
    if args_reuse and (out / "int8").is_dir() and any((out / "int8").glob("*.onnx")):
        log(f"optimum: reusing {out}")
        return {"optimum fp32": out / "fp32" / "model.onnx", "optimum int8 (ORTQuantizer)": next((out / "int8").glob("*.onnx"))}
    res = subprocess.run([str(py), str(script), str(hf), str(out)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"optimum export failed:\n{res.stderr[-3000:]}")
    times = json.loads(res.stdout.split("OPTIMUM_TIMES ", 1)[1].splitlines()[0])
    log(f"optimum: export {times['export_s']:.0f}s, ORTQuantizer {times['quantize_s']:.0f}s")
    int8 = next((out / "int8").glob("*.onnx"))
    return {"optimum fp32": out / "fp32" / "model.onnx", "optimum int8 (ORTQuantizer)": int8}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median) after one warm-up")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_onnxruntime"))
    ap.add_argument("--output", type=Path, default=Path("/tmp/bench_onnxruntime.txt"))
    ap.add_argument("--reuse", action="store_true", help="reuse exports already in --work-dir")
    ap.add_argument("--skip", nargs="*", default=[], help="row names to leave out (e.g. 'optimum fp32')")
    ap.add_argument("--calibrate-method", default="minmax", choices=["minmax", "entropy", "percentile"])
    ap.add_argument("--with-optimum", action="store_true", help="also export + quantize with optimum-onnx (own venv)")
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    from export.onnxruntime import OnnxRuntimeExporter, OnnxRuntimeRunner
    from export.runtime import EagerRunner
    from train.corpus import load_text, split_corpus, tokenize, windows
    from train.sources import BundledSource, load_model

    lm = load_model(BundledSource(name="smollm2-135m"))
    ids = tokenize(load_text("pydoc"), lm.tokenizer)
    splits = split_corpus(ids, eval_tokens=4096, calib_tokens=2048)
    calib = windows(splits.calib_ids, 512)  # disjoint from the evaluation span
    prompt = ids[5000:5512]
    log(f"SmolLM2-135M, {args.threads} threads, runs={args.runs}+1 warm-up, decode {args.decode_tokens} tokens; "
        f"calibration {len(calib)}x512 tokens after the eval span; load avg {os.getloadavg()[0]:.1f} at start")

    # With --reuse, rows measured by an earlier (interrupted) run are taken from this cache.
    cache_path = args.work_dir / "results.json"
    cached = json.loads(cache_path.read_text()) if args.reuse and cache_path.exists() else {}
    results: dict[str, dict] = {}

    def record(name: str, row: dict) -> None:
        results[name] = row
        log(f"{name}: {json.dumps(row)}" + (" (cached)" if name in cached else ""))
        args.work_dir.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cached | results, indent=1))

    if "eager fp32" in cached:
        record("eager fp32", cached["eager fp32"])
    else:
        eager = EagerRunner(lm.model)
        eager.size_bytes = lambda: sum(p.numel() * p.element_size() for p in lm.model.parameters())  # type: ignore[method-assign]
        record("eager fp32", measure(eager, splits.eval_ids, prompt, args.runs, args.decode_tokens))

    ex = OnnxRuntimeExporter()
    variants = {"ORT fp32": {}, "ORT dynamic int8": {"quantize": "dynamic"},
                "ORT static int8": {"quantize": "static", "calibrate_method": args.calibrate_method},
                # down_proj's input (the SwiGLU product) has outlier channels that per-tensor
                # activation scales cannot hold: keeping it fp32 is the accuracy variant...
                "ORT dynamic int8 -down_proj": {"quantize": "dynamic", "exclude_modules": ["*.mlp.down_proj"]},
                "ORT static int8 -down_proj": {"quantize": "static", "calibrate_method": args.calibrate_method,
                                               "exclude_modules": ["*.mlp.down_proj"]},
                # ...and int8 lm_head + per-row int8 embedding is the size variant.
                "ORT dynamic int8 +head+emb": {"quantize": "dynamic", "quantize_lm_head": True, "quantize_embedding": True}}
    fp32_dir = args.work_dir / "ORT_fp32"
    skip = set(args.skip)
    for name, opts in variants.items():
        if name in skip:
            continue
        if name in cached:
            record(name, cached[name])
            continue
        out = args.work_dir / name.replace(" ", "_").replace("+", "").replace("-", "no_")
        t = time.perf_counter()
        built = not (args.reuse and (out / "manifest.json").exists())
        if built:
            if opts:  # INT8 from the fp32 export: tracing once is the slow part
                ex.quantize_export(fp32_dir / "model.onnx", out, opts, calibration=calib, log=log)
            else:
                ex.export(lm.model, lm.tokenizer, out, opts, log=log)
        export_s = time.perf_counter() - t if built else float("nan")  # nan: reused from an earlier run
        runner = ex.load(out / "model.onnx", intra_op_threads=args.threads)
        record(name, measure(runner, splits.eval_ids, prompt, args.runs, args.decode_tokens) | {"export_s": export_s})
        runner.close()

    if args.with_optimum:
        try:
            for name, path in run_optimum(lm, args.work_dir, log, args.reuse).items():
                if name in skip:
                    continue
                if name in cached:
                    record(name, cached[name])
                    continue
                runner = OnnxRuntimeRunner(path, intra_op_threads=args.threads, max_seq_len=None)
                record(name, measure(runner, splits.eval_ids, prompt, args.runs, args.decode_tokens))
        except Exception as exc:  # report it, keep our own numbers
            log(f"--with-optimum did not work: {type(exc).__name__}: {str(exc)[-1500:]}")

    base = results["ORT fp32"]
    head = (f"{'runtime':30s} {'prefill128 ms':>13s} {'prefill512 ms':>13s} {'decode tok/s':>12s} {'size MB':>8s} "
            f"{'ppl':>7s} {'build s':>7s} | {'x pf128':>7s} {'x pf512':>7s} {'x decode':>8s} {'x size':>6s} {'ppl %':>6s}")
    log("")
    log(head)
    log("-" * len(head))
    for name, r in results.items():
        log(f"{name:30s} {r['prefill128_ms']:13.1f} {r['prefill512_ms']:13.1f} {r['decode_tok_s']:12.1f} "
            f"{r['size_mb']:8.1f} {r['ppl']:7.2f} {r.get('export_s', float('nan')):7.0f} | {r['prefill128_ms'] / base['prefill128_ms']:7.2f} "
            f"{r['prefill512_ms'] / base['prefill512_ms']:7.2f} {r['decode_tok_s'] / base['decode_tok_s']:8.2f} "
            f"{r['size_mb'] / base['size_mb']:6.2f} {100 * (r['ppl'] / base['ppl'] - 1):+6.1f}")
    log("")
    log(f"goals: {GOALS}")
    for name in [n for n in results if "int8" in n and n.startswith("ORT")]:
        tol = 2.0 if "static" in name else 3.0
        r = results[name]
        checks = {"prefill<=0.5x": r["prefill128_ms"] <= 0.5 * base["prefill128_ms"] and r["prefill512_ms"] <= 0.5 * base["prefill512_ms"],
                  "file<=0.3x": r["size_mb"] <= 0.3 * base["size_mb"],
                  f"ppl<=+{tol:g}%": r["ppl"] <= base["ppl"] * (1 + tol / 100)}
        log(f"  {name}: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in checks.items()))
    log(f"load avg at end {os.getloadavg()[0]:.1f} (2 shared cores: timings are noisy)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    return 0


def optimum_only(argv=None) -> int:
    """Export + quantize with optimum only (to prepare ``--reuse`` runs)."""
    from train.sources import BundledSource, load_model

    run_optimum(load_model(BundledSource(name="smollm2-135m")), Path(argv[0]), print)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--optimum-only"]:
        sys.exit(optimum_only(sys.argv[2:]))
    sys.exit(main())
