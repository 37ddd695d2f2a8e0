"""Training memory and speed on SmolLM2-135M: each memory option against the fp32 baseline.

Every option runs in its own fresh process (so one option's allocations cannot inflate the
next one's peak) through the trainer's Python API: ``train.loop.train`` on real pydoc text
(after the evaluation span), micro-batch 1, ``--seq`` tokens, ``--steps`` optimizer steps.

Method: on CPU the peak is the process's peak RSS (``VmHWM``), reset by writing ``5`` to
``/proc/self/clear_refs`` after the model is prepared (LoRA/NF4/sharding applied), so it
is the training-step peak including the resident model. On CUDA it would be
``torch.cuda.max_memory_allocated``. tokens/s is the median over steps 2.. (step 1 carries
one-off costs such as AdamW8bit's compile). FSDP2 runs 2 ranks x 1 thread under torchrun
and reports the per-rank peak (max over ranks); single-process rows use 2 threads.

    OMP_NUM_THREADS=2 .venv/bin/python bench/train_memory.py [--seq 256] [--steps 3] [--out /tmp/bench_train.txt]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import run_json_child  # noqa: E402

#: option -> (LoopConfig overrides, note)
OPTIONS: dict[str, tuple[dict, str]] = {
    "baseline fp32": ({}, "AdamW, fp32"),
    "activation checkpointing": ({"memory": {"activation_checkpointing": "full"}}, "full, every block"),
    "activation offload": ({"memory": {"activation_offload": True}}, "save_on_cpu"),
    "8-bit AdamW": ({"optimizer": {"name": "adamw8bit"}}, "torchao AdamW8bit"),
    "optimizer CPU offload": ({"optimizer": {"cpu_offload": True}}, "torchao CPUOffloadOptimizer"),
    "LoRA r=8": ({"lora": {"enabled": True}}, "peft, 7 projections"),
    "QLoRA r=8 (NF4)": ({"lora": {"enabled": True, "quantize_base": "nf4"}}, "torchao NF4 base"),
    "FSDP2 2 ranks": ({"distributed": {"fsdp": True}}, "gloo, per-rank peak"),
}

CPU_NOTES = {
    "activation offload": "CPU-only run: activations already in host memory; the copy adds work, saves nothing",
    "optimizer CPU offload": "CUDA/XPU only in torchao 0.18; on CPU the states are already on host (no-op)",
    "FSDP2 2 ranks": "per rank; both ranks share this machine's RAM",
}


def _one(option: str, seq: int, steps: int, out_json: Path) -> None:
    """Child process: train one option and write its figures as JSON (rank 0)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from train.config import LoopConfig
    from targets.sources.corpus import load_text, tokenize
    from train.loop import train
    from targets.sources import BundledSource, load_model

    loaded = load_model(BundledSource(name="smollm2-135m"))
    ids = tokenize(load_text("pydoc"), loaded.tokenizer)[4097:]
    ids = ids[: (seq + 1) * (steps + 2)]
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    overrides, _ = OPTIONS[option]
    cfg = LoopConfig(
        output_dir=work,
        max_steps=steps,
        batch={"micro_batch_size": 1, "grad_accum_steps": 1},
        checkpoint={"resume": False, "save_final": False, "export_hf": False},
        logging={"progress_bar": False, "csv": True},
        **overrides,
    )
    res = train(loaded.model, ids, cfg, seq_len=seq)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    with open(work / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    tps = [float(r["tokens_per_s"]) for r in rows[1:]] or [float(rows[0]["tokens_per_s"])]
    out_json.write_text(
        json.dumps(
            {
                "peak_mib": res.peak_mem_mib,
                "tokens_per_s": statistics.median(tps),
                "trainable": res.trainable_params,
                "loss_first": res.losses[1],
                "loss_last": res.losses[steps],
            }
        )
    )


def _launch(option: str, seq: int, steps: int, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench_train_res_")) / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = ["--one", option, "--seq", str(seq), "--steps", str(steps), "--result", str(out)]
    if "FSDP2" in option:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *args]
    else:
        env.setdefault("OMP_NUM_THREADS", "2")
        cmd = [sys.executable, __file__, *args]
    return run_json_child(cmd, out, env, timeout, tail=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/bench_train.txt")
    ap.add_argument("--only", nargs="*", help="option names to run (default: all)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        _one(a.one, a.seq, a.steps, Path(a.result))
        return
    results = {}
    for option in a.only or OPTIONS:
        print(f"running {option} ...", flush=True)
        results[option] = _launch(option, a.seq, a.steps, a.timeout)
        print(f"  {results[option]}", flush=True)
    base = results.get("baseline fp32", {})
    lines = [
        f"SmolLM2-135M training, seq {a.seq}, micro-batch 1, {a.steps} steps, pydoc text; CPU "
        f"(peak RSS via VmHWM after model prep; tok/s median of steps 2..{a.steps})",
        f"{'option':28} {'peak MiB':>9} {'vs fp32':>8} {'tok/s':>7} {'vs fp32':>8} {'trainable':>11}  note",
    ]
    for option, r in results.items():
        note = CPU_NOTES.get(option, OPTIONS[option][1])
        if "error" in r:
            lines.append(f"{option:28} {'-':>9} {'-':>8} {'-':>7} {'-':>8} {'-':>11}  {r['error']}")
            continue
        mem_ratio = f"{r['peak_mib'] / base['peak_mib']:.2f}x" if "peak_mib" in base else "-"
        tps_ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if "tokens_per_s" in base else "-"
        lines.append(
            f"{option:28} {r['peak_mib']:9.0f} {mem_ratio:>8} {r['tokens_per_s']:7.1f} {tps_ratio:>8}"
            f" {r['trainable']:11,d}  {note}"
        )
    text = "\n".join(lines) + "\n"
    from targets.atomic import atomic_write_text

    atomic_write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
