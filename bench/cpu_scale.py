"""A 1B-class model's calibration stages on the CPU: the run's peak RSS against the model's bf16 bytes.

Issue #27's CPU goal: a 1B-class model goes through ``awq -> ptq_int8`` (GPTQ) on a 24 GiB machine
without a second full copy of the model, at a peak RSS of at most 2.5x its bf16 weights. The model
is Llama-3.2-1B's shape (``bench/gpu.py``'s ``scale`` section, random init: memory and time, not
accuracy), loaded in bfloat16; GPTQ calibrates on ``--windows`` windows of 512 tokens in the model's
own dtype (what ``calibration_dtype: auto`` picks at this size), ``lm_head`` at int8. The pipeline
runs in a child process, so the peak (``ru_maxrss`` of that child) is the run's alone; each row's
own peak comes from the pipeline's report. There is no peer to run beside it: the ratio is against
the weights' own bytes.

    .venv/bin/python bench/cpu_scale.py [--blocks 16] [--windows 4] [--threads 2]

At 16 blocks on 2 cores (AMD EPYC, 2026-11-27) it takes about 25 minutes; ``--blocks 2`` checks the
script in about 3 (the embedding and head stay full size, so the ratio is not the 1B model's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import REPO, print_results  # noqa: E402
from bench.gpu import SHAPES, _stage_config  # noqa: E402

#: the issue's goal: the run's peak RSS over the model's bf16 weight bytes
GOAL_RATIO = 2.5


def config(blocks: int, windows: int, tokenizer: str) -> dict:
    shape = dict(SHAPES["llama-3.2-1b"], num_hidden_layers=blocks)
    model = {"source": "random", "seed": 0, "dtype": "bfloat16", "tokenizer": tokenizer, "config": shape}
    stages = [{"kind": "awq", "scheme": "8da4w", "keep_high_precision": [], "calibration_dtype": "model"},
              {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32, "algorithm": "gptq",
               "gptq": {"calibration_windows": windows, "calibration_dtype": "model"}, "keep_high_precision": [],
               "int8_modules": ["lm_head"]}]
    return _stage_config(f"cpu-scale-{blocks}", model, stages, "cpu", dtype="bfloat16",
                         calibration_tokens=512 * max(windows, 8))


def bf16_bytes(shape: dict) -> int:
    """The bf16 bytes of the weights as loaded (a tied head counted once, as memory holds it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import torch

    cfg = AutoConfig.for_model(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return 2 * sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once


def table(res: dict) -> str:
    out = [f"Llama-3.2-1B shape, {res['blocks']} blocks, bf16 weights {res['weights_mib']:.0f} MiB, "
           f"{res['threads']} threads, GPTQ on {res['windows']} windows", "",
           "| row | status | wall s | peak RSS MiB (the row's) | x bf16 weights |", "|---|---|---:|---:|---:|"]
    for r in res.get("rows", []):
        peak = r.get("peak_rss_mb")
        out.append(f"| {r['name']} | {r['status']} | {r['wall_s'] or 0:.0f} | {peak or '-'} | "
                   f"{peak / res['weights_mib']:.2f} |" if peak else f"| {r['name']} | {r['status']} | | | |")
    if "error" in res:
        out.append(f"| the run | failed: {res['error'][:200]} | | | |")
    if res.get("peak_mib"):
        ok = res["ratio"] <= GOAL_RATIO
        out += ["", f"The run's peak RSS (the child's ru_maxrss): **{res['peak_mib']:.0f} MiB, {res['ratio']:.2f}x** "
                    f"the bf16 weights; goal <= {GOAL_RATIO}x: {'met' if ok else 'NOT met'} "
                    f"({res['wall_s']:.0f} s)."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=16, help="decoder blocks (Llama-3.2-1B has 16)")
    ap.add_argument("--windows", type=int, default=4, help="GPTQ calibration windows of 512 tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokenizer", default="smollm2-135m", help="a saved tokenizer folder, or the bundled SmolLM2's")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_cpu_scale"), help="cpu_scale.md and .json go here")
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.windows < 1 or args.threads < 1:
        ap.error("--blocks, --windows and --threads must be at least 1")
    cfg = config(args.blocks, args.windows, args.tokenizer)
    weights = bf16_bytes(cfg["model"]["config"]) / 2**20
    res: dict = {"blocks": args.blocks, "windows": args.windows, "threads": args.threads, "weights_mib": weights}
    result = Path(tempfile.mkdtemp(prefix="bench_cpu_scale_")) / "r.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(HERE / "gpu.py"), "--child", "pipeline", "--spec",
                           json.dumps({"config": cfg, "threads": args.threads}), "--result", str(result)],
                          cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    res["wall_s"] = time.time() - t0
    res["peak_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    res["ratio"] = res["peak_mib"] / weights
    if proc.returncode or not result.exists():
        res["error"] = f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    else:
        rows = json.loads(result.read_text())["report"]["rows"]
        res["rows"] = [{"name": r["name"], "status": r["status"], "wall_s": r["wall_s"],
                        "peak_rss_mb": (r.get("resources") or {}).get("peak_rss_mb")} for r in rows]
    text = table(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_scale.md").write_text(text + "\n")
    print_results("bench/cpu_scale.py", text, res, args.out / "cpu_scale.json")
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
