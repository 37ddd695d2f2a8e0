"""Benchmark the ONNX Runtime target on SmolLM2-135M against onnxruntime-genai's model builder.

Rows, each built in this run and measured by the same loop:

- ``ours fp32``: the fused graph (the exporter's default), fp32;
- ``ours W8A8``: the ``examples/smollm2_onnx.yaml`` recipe (its stages, then its export options);
- ``ours 4-bit``: the ``examples/smollm2_onnx_int4.yaml`` recipe (AWQ + GPTQ, int4 groups of 32);
- ``builder fp32 / int8 / int4`` (``--with-genai``): onnxruntime-genai's model builder on the same
  Hugging Face folder, ``-p fp32|int8|int4 -e cpu`` with its defaults (through its Python API:
  its ``--help`` crashes).

The loop is the project's reference measurement (shared notes): perplexity over the first 4097
pydoc tokens (4096 targets) in 512-token windows; prompts from offset 5000; 2 threads; median of
``--runs`` (>= 3) after a warm-up. Every row runs in a plain ``InferenceSession``
(:class:`export.onnxruntime.runner.OnnxRuntimeRunner`) and its decode also through onnxruntime-genai's
``Generator`` (``genai decode``). ``build s`` is the stages plus the export for our rows, the
builder's run for its rows. ``--with-pipeline`` also times ``optimize pipeline`` on the W8A8
recipe end to end (its own checks included).

    flock /tmp/heavy.lock env OMP_NUM_THREADS=2 .venv/bin/python bench/onnxruntime.py --with-genai
"""

from __future__ import annotations

import argparse
import copy
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

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"ours W8A8": ROOT / "examples" / "smollm2_onnx.yaml", "ours 4-bit": ROOT / "examples" / "smollm2_onnx_int4.yaml"}
PEERS = {"ours fp32": "builder fp32", "ours W8A8": "builder int8", "ours 4-bit": "builder int4"}
GOALS = ("4-bit: decode >= 1.0x builder int4, ppl <= +10%, size <= 1.1x builder int4; W8A8: decode >= 1.0x builder int8, "
         "ppl <= +2%, size <= 0.35x fp32, prefill-128 <= 65 ms; fp32: decode >= 1.0x builder fp32; pipeline <= 120 s")


def measure(runner, genai, eval_ids, prompt, runs: int, decode_tokens: int) -> dict:
    from export.verify import latency, perplexity

    ppl = perplexity(runner, eval_ids, 512)["perplexity"]
    lat = latency(runner, prompt[:128], decode_tokens, runs=runs)
    row = {"ppl": ppl, "prefill128_ms": lat["prefill_ms"], "decode_tok_s": lat["decode_tok_s"],
           "size_mib": runner.size_bytes() / 2**20}
    if genai is not None:
        glat = latency(genai, prompt[:128], decode_tokens, runs=runs)
        row.update(genai_prefill128_ms=glat["prefill_ms"], genai_decode_tok_s=glat["decode_tok_s"])
    return row


def build_ours(name: str, lm, splits, out: Path, log) -> tuple[Path, float, dict]:
    """Apply a recipe's stages (as the pipeline would) and export; returns (dir, seconds, info)."""
    from export.onnxruntime.exporter import OnnxRuntimeExporter
    from optimize.config import load_config
    from optimize.config_checks import export_options
    from optimize.stage_api import StageContext, get_stage
    from targets import load_target
    from targets.sources.corpus import windows

    t = time.perf_counter()
    model = copy.deepcopy(lm.model)
    opts = None  # the exporter's defaults
    if name in RECIPES:
        cfg = load_config(RECIPES[name], check_model=False)
        calib = windows(splits.calib_ids, cfg.data.seq_len)
        for i, stage in enumerate(cfg.stages):
            spec = get_stage(stage.kind)
            ctx = StageContext(tokenizer=lm.tokenizer, calibration=calib, train_ids=splits.train_ids,
                               target=load_target("onnxruntime"), work_dir=out.parent / "work", seed=cfg.seed,
                               log=lambda *a: None)
            torch.manual_seed(cfg.seed + i + 1)
            model = spec.fn(model, stage, ctx).eval()
            log(f"{name}: stage {stage.kind} done at {time.perf_counter() - t:.0f}s")
        # the validated options object itself: a dict dump would mark every field as given by
        # the user, and the options refuse those that do not apply (e.g. calibrate_method)
        opts = export_options(cfg, "onnxruntime", load_target("onnxruntime"))
    res = OnnxRuntimeExporter().export(model, lm.tokenizer, out, opts, log=lambda *a: None)
    info = {"ops": res.manifest["ops"], "quantization": res.manifest["quantization"],
            "timings_s": res.manifest.get("build_timings_s")}
    return out, time.perf_counter() - t, info


def build_peer(precision: str, hf_dir: Path, out: Path) -> tuple[Path, float]:
    from export.onnxruntime.genai_builder import build

    t = time.perf_counter()
    build(hf_dir, out, precision=precision, extra_options={})
    return out, time.perf_counter() - t


def run_pipeline(log) -> float | None:
    """Wall time of ``optimize pipeline examples/smollm2_onnx.yaml`` (checks included)."""
    exe = Path(sys.executable).with_name("optimize")
    t = time.perf_counter()
    res = subprocess.run([str(exe), "pipeline", str(RECIPES["ours W8A8"]), "--output", "/tmp/bench_ort_pipeline"],
                         capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        log(f"optimize pipeline failed (rc {res.returncode}): {res.stderr[-1500:]}")
        return None
    return wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median) after one warm-up")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_onnxruntime"))
    ap.add_argument("--output", type=Path, default=Path("/tmp/bench_onnxruntime.txt"))
    ap.add_argument("--rows", nargs="*", default=None, help="only these rows (e.g. 'ours 4-bit' 'builder int4')")
    ap.add_argument("--with-genai", action="store_true", help="also build the model builder's fp32/int8/int4 rows")
    ap.add_argument("--with-pipeline", action="store_true", help="also time `optimize pipeline` on the W8A8 recipe")
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be >= 3 (the reference method's median)")

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    from export.onnxruntime.genai_runner import GenaiRunner
    from export.onnxruntime.runner import OnnxRuntimeRunner
    from targets.sources.corpus import load_text, split_corpus, tokenize
    from targets.sources import BundledSource, load_model

    lm = load_model(BundledSource(name="smollm2-135m"))
    ids = tokenize(load_text("pydoc"), lm.tokenizer)
    splits = split_corpus(ids, eval_tokens=4096, calib_tokens=4096)
    prompt = ids[5000:5512]
    log(f"SmolLM2-135M, {args.threads} threads, runs={args.runs}+1 warm-up, prefill 128 tokens, decode "
        f"{args.decode_tokens} tokens; load avg {os.getloadavg()[0]:.1f} at start")

    names = ["ours fp32", "ours W8A8", "ours 4-bit"] + (["builder fp32", "builder int8", "builder int4"] if args.with_genai else [])
    if args.rows is not None:
        names = [n for n in names if n in args.rows]
    results: dict[str, dict] = {}
    for name in names:
        out = args.work_dir / name.replace(" ", "_")
        try:
            if name.startswith("builder"):
                path, build_s = build_peer(name.split()[1], Path(lm.local_dir), out)
                info = {}
            else:
                path, build_s, info = build_ours(name, lm, splits, out, log)
            runner = OnnxRuntimeRunner(path / "model.onnx", intra_op_threads=args.threads, max_seq_len=None)
            genai = GenaiRunner(path, max_seq_len=2048, intra_op_threads=args.threads)
            row = measure(runner, genai, splits.eval_ids, prompt, args.runs, args.decode_tokens) | {"build_s": build_s}
            from export.onnxruntime.fused import op_counts

            row["ops"] = info.get("ops") or op_counts(path / "model.onnx")
            row["nodes"] = sum(row["ops"].values())
            runner.close()
            genai.close()
        except Exception as exc:  # report it, keep the other rows
            log(f"{name}: FAILED {type(exc).__name__}: {str(exc)[-1500:]}")
            continue
        results[name] = row
        log(f"{name}: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "ops"}))
    pipeline_s = run_pipeline(log) if args.with_pipeline else None

    fp32 = results.get("ours fp32") or results.get("builder fp32")
    head = (f"{'row':14s} {'size MiB':>9s} {'prefill128 ms':>13s} {'decode tok/s':>12s} {'genai dec':>9s} {'ppl':>7s} "
            f"{'ppl %':>6s} {'build s':>7s} {'nodes':>6s} | {'x peer decode':>13s} {'x peer size':>11s} {'x peer pf':>9s}")
    log("")
    log(head)
    log("-" * len(head))
    for name, r in results.items():
        peer = results.get(PEERS.get(name, ""))
        ratio = (lambda k, inv=False: f"{(peer[k] / r[k] if inv else r[k] / peer[k]):.2f}") if peer else (lambda *a, **k: "-")
        dppl = 100 * (r["ppl"] / fp32["ppl"] - 1) if fp32 else float("nan")
        log(f"{name:14s} {r['size_mib']:9.1f} {r['prefill128_ms']:13.1f} {r['decode_tok_s']:12.1f} "
            f"{r.get('genai_decode_tok_s', float('nan')):9.1f} {r['ppl']:7.3f} {dppl:+6.1f} {r['build_s']:7.1f} "
            f"{r['nodes']:6d} | {ratio('decode_tok_s'):>13s} {ratio('size_mib'):>11s} {ratio('prefill128_ms'):>9s}")
    log("")
    if pipeline_s is not None:
        log(f"optimize pipeline {RECIPES['ours W8A8'].name}: {pipeline_s:.0f} s wall (checks included)")
    log(f"goals: {GOALS}")
    for name in ("ours fp32", "ours W8A8", "ours 4-bit"):
        if name in results:
            log(f"  {name} ops: {json.dumps(results[name]['ops'])}")
    log(f"load avg at end {os.getloadavg()[0]:.1f} (shared cores: timings are noisy, compare ratios within this run)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    (args.work_dir / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
