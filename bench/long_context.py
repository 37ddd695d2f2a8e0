"""Training memory and time per step against sequence length, per attention/loss/checkpointing choice.

Model: SmolLM2-135M-shaped but shallow (hidden 576, 9 query / 3 KV heads, MLP 1536, vocab 49152,
tied embeddings, ``--layers`` blocks), random init, fp32, micro-batch 1, AdamW, random token
ids (the ids do not change memory or time). Each (configuration, length) runs in a fresh
process, because process-wide peak RSS only ever grows: one step's allocations would hide the
next one's. In that process: build the model, apply the trainer's own attention setup
(``train.attention``), activation checkpointing (``train.memory``) and loss
(``train.chunked_loss`` or the plain full-logits loss), run one short warm-up optimizer step
(256 tokens: it allocates the AdamW states), then measure one step at the full length (the
attention kernel that ran is observed in its forward):

- ``peak``: peak RSS of the process during the measured step (CPU; VmHWM reset just before it),
  or ``torch.cuda.max_memory_allocated`` (CUDA);
- ``step``: that peak minus the memory resident just before the step (weights, AdamW states):
  the step's own working memory (activations, logits, gradients), the part that grows with length;
- ``time``: wall time of the measured step (``--steps`` > 1: the median).

The ``exp`` columns fit ``y ~ n^k`` over the lengths >= ``--fit-from`` (past the 512-token window):
about 1 is linear, 2 quadratic. Configurations whose quadratic memory would exceed ``--max-mib``
are skipped (shown as ``-``), e.g. eager attention at 8k tokens (~2.4 GB of scores per layer).

    OMP_NUM_THREADS=2 .venv/bin/python bench/long_context.py [--lengths 512 1024 2048 4096 8192]
        [--layers 2] [--device cpu|cuda] [--precision fp32|bf16] [--out /tmp/bench_long_context.txt]

``--device cuda`` adds the GPU-only rows (flash-attn ``flash_attention_2``, SDPA forced to its
flash and memory-efficient kernels) and defaults to bf16 autocast; no GPU was available where
this was written, so the CUDA path is untested here. Timings on a shared CPU are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import run_json_child  # noqa: E402
WINDOW = 512

#: name -> (LoopConfig overrides, devices, what it shows)
CONFIGS: dict[str, tuple[dict, tuple[str, ...], str]] = {
    "eager": ({"attention": {"backend": "eager"}, "loss": {"chunked": False}}, ("cpu", "cuda"),
              "matmul + softmax: [T, T] scores per head"),
    "sdpa": ({"attention": {"backend": "sdpa"}, "loss": {"chunked": False}}, ("cpu", "cuda"),
             "SDPA, dispatcher's kernel; plain CE"),
    "sdpa-math": ({"attention": {"backend": "sdpa", "sdpa_kernel": "math"}, "loss": {"chunked": False}},
                  ("cpu", "cuda"), "SDPA forced to its math kernel"),
    "sdpa+chunkedCE": ({"attention": {"backend": "sdpa"}, "loss": {"chunked": True}}, ("cpu", "cuda"),
                       "chunked cross-entropy (1024-token chunks)"),
    "sdpa+chunkedCE+ckpt": ({"attention": {"backend": "sdpa"}, "loss": {"chunked": True},
                             "memory": {"activation_checkpointing": "full"}}, ("cpu", "cuda"),
                            "+ full activation checkpointing"),
    "window512+chunkedCE": ({"attention": {"backend": "sdpa", "sliding_window": WINDOW}, "loss": {"chunked": True}},
                            ("cpu", "cuda"), "sliding window 512, blockwise"),
    "window512+chunkedCE+ckpt": ({"attention": {"backend": "sdpa", "sliding_window": WINDOW}, "loss": {"chunked": True},
                                  "memory": {"activation_checkpointing": "full"}}, ("cpu", "cuda"),
                                 "+ full activation checkpointing"),
    "window512-mask+chunkedCE": ({"attention": {"backend": "sdpa", "sliding_window": WINDOW, "window_impl": "mask"},
                                  "loss": {"chunked": True}}, ("cpu", "cuda"), "same window as one dense [T, T] mask"),
    "flash_attention_2+chunkedCE": ({"attention": {"backend": "flash_attention_2"}, "loss": {"chunked": True}},
                                    ("cuda",), "flash-attn package (GPU only)"),
    "sdpa-flash+chunkedCE": ({"attention": {"backend": "sdpa", "sdpa_kernel": "flash"}, "loss": {"chunked": True}},
                             ("cuda",), "SDPA forced to flash (GPU)"),
    "sdpa-efficient+window512": ({"attention": {"backend": "sdpa", "sdpa_kernel": "efficient",
                                                "sliding_window": WINDOW}, "loss": {"chunked": True}},
                                 ("cuda",), "masked blocks on the memory-efficient kernel (GPU)"),
}

#: left out of the default run (time budget); ask for them with --only
OPTIONAL = {"sdpa-math", "window512-mask+chunkedCE"}

#: rough bytes per (length^2 x layer) of configurations that hold [T, T] attention scores
QUADRATIC = {"eager": 9 * 4 * 3, "sdpa-math": 9 * 4 * 3, "window512-mask+chunkedCE": 1}


def _model(layers: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=16384, tie_word_embeddings=True,
        rope_theta=100000.0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _one(name: str, length: int, layers: int, steps: int, device_name: str, precision: str, out: Path) -> None:
    """Child process: one configuration at one length; writes its figures as JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from train.attention import KernelRecorder, configure_attention
    from train.chunked_loss import chunked_lm_loss
    from train.config import LoopConfig
    from train.distributed import DistContext
    from train.loop import prepare_model
    from train.step import causal_lm_loss
    from train.memory import peak_memory_mib, reset_peak_memory

    device = torch.device(device_name)
    cfg = LoopConfig(device=device_name, precision={"mode": precision}, **CONFIGS[name][0])
    model = _model(layers)
    low = precision == "bf16"
    setup = configure_attention(model, cfg.attention, device, torch.bfloat16 if low else torch.float32, length + 1)
    model = prepare_model(model, cfg, DistContext(device=device))
    loss_fn = chunked_lm_loss(cfg.loss.chunk_size) if cfg.loss.chunked else causal_lm_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 49152, (1, length + 1), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def step(batch, record: bool = False) -> float:
        with setup.context(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
            if record:
                with KernelRecorder() as rec:
                    loss = loss_fn(model, batch)
                setup.observe(batch["input_ids"].shape[1], rec.observed())
            else:
                loss = loss_fn(model, batch)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    warm = min(256, length)
    step({"input_ids": ids[:, :warm], "labels": ids[:, 1 : warm + 1]})  # AdamW states exist from here on
    times, peaks, deltas = [], [], []
    for i in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(device) / 2**20
        else:
            base = _rss_mib()
        reset_peak_memory(device)
        t0 = time.perf_counter()
        step(batch, record=i == 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = peak_memory_mib(device)
        peaks.append(peak)
        deltas.append(peak - base)
    out.write_text(json.dumps({
        "peak_mib": max(peaks), "step_mib": max(deltas), "time_s": statistics.median(times), "kernel": setup.kernel,
    }))


def _launch(name: str, length: int, args) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench_lc_")) / "r.json"
    cmd = [sys.executable, __file__, "--one", name, "--one-length", str(length), "--layers", str(args.layers),
           "--steps", str(args.steps), "--device", args.device, "--precision", args.precision, "--result", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.setdefault("OMP_NUM_THREADS", "2")
    return run_json_child(cmd, out, env, args.timeout)


def _exponent(points: list[tuple[int, float]]) -> str:
    pts = [(math.log(n), math.log(y)) for n, y in points if y > 0]
    if len(pts) < 2:
        return "-"
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return f"{sum((x - mx) * (y - my) for x, y in pts) / var:.2f}" if var else "-"


def _table(results: dict, lengths: list[int], args) -> str:
    def cell(r, key, fmt):
        return fmt.format(r[key]) if r and key in r else "-"

    head = " ".join(f"{n // 1024}k".rjust(7) if n >= 1024 else f"{n}".rjust(7) for n in lengths)
    lines = [
        f"Long-context training, {args.device}: SmolLM2-135M-shaped, {args.layers} layers, vocab 49152, {args.precision}, "
        f"micro-batch 1, AdamW; fresh process per cell; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '2')}",
        f"exp = fitted k in y ~ n^k over lengths >= {args.fit_from}; '-' = skipped (quadratic memory over "
        f"--max-mib {args.max_mib}) or failed",
        "",
    ]
    for title, key, fmt in [("peak memory of the step, MiB (process peak RSS / CUDA max allocated)", "peak_mib", "{:.0f}"),
                            ("step working memory above the resident model + AdamW states, MiB", "step_mib", "{:.0f}"),
                            ("time per optimizer step, s", "time_s", "{:.2f}")]:
        lines.append(title)
        lines.append(f"{'configuration':28} {head}    exp  kernel")
        for name, by_len in results.items():
            row = [cell(by_len.get(n), key, fmt).rjust(7) for n in lengths]
            fit = [(n, by_len[n][key]) for n in lengths if n >= args.fit_from and key in by_len.get(n, {})]
            kernel = next((r["kernel"] for r in by_len.values() if "kernel" in r), "")
            lines.append(f"{name:28} {' '.join(row)} {_exponent(fit):>6}  {kernel}")
        lines.append("")
    ratios = []
    for n in lengths:
        a, b = results.get("sdpa", {}).get(n, {}), results.get("sdpa+chunkedCE", {}).get(n, {})
        if "peak_mib" in a and "peak_mib" in b:
            ratios.append(f"{n}: peak {b['peak_mib'] / a['peak_mib']:.2f}x, step {b['step_mib'] / a['step_mib']:.2f}x")
    if ratios:
        lines.append("chunked CE / plain CE (both SDPA): " + "; ".join(ratios) + "  (goal: <= 0.5x at 4096)")
    errors = [f"  {name} @ {n}: {r['error']}" for name, by in results.items() for n, r in by.items() if "error" in r]
    if errors:
        lines += ["", "errors:", *errors]
    notes = {name: CONFIGS[name][2] for name in results}
    lines += ["", "configurations:"] + [f"  {k:28} {v}" for k, v in notes.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1, help="measured steps per cell (after one warm-up step)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], help="default: fp32 on cpu, bf16 autocast on cuda "
                    "(flash-attn has no fp32 kernels)")
    ap.add_argument("--only", nargs="*", help="configuration names (default: all for the device)")
    ap.add_argument("--max-mib", type=float, default=6000, help="skip cells whose [T, T] scores alone would exceed this")
    ap.add_argument("--fit-from", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="/tmp/bench_long_context.txt")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
    if a.one:
        _one(a.one, a.one_length, a.layers, a.steps, a.device, a.precision, Path(a.result))
        return
    sys.path.insert(0, str(REPO))
    from targets.atomic import atomic_write_text

    names = a.only or [n for n, (_, devices, _) in CONFIGS.items() if a.device in devices and n not in OPTIONAL]
    results: dict[str, dict[int, dict]] = {}
    t0 = time.time()
    for name in names:
        results[name] = {}
        for n in a.lengths:
            quad = QUADRATIC.get(name, 0) * n * n * a.layers / 2**20
            if quad > a.max_mib:
                print(f"skip {name} @ {n}: ~{quad:.0f} MiB of [T, T] scores > --max-mib", flush=True)
                continue
            r = _launch(name, n, a)
            results[name][n] = r
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
            print(f"{name} @ {n}: {shown}", flush=True)
        # the table so far, after every configuration: a run stopped part-way still leaves its rows
        text = _table(results, a.lengths, a) + f"\ntotal bench time {time.time() - t0:.0f} s\n"
        atomic_write_text(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
