"""Benchmark the TorchChat target on SmolLM2-135M: model.pth, model.pt2 and model.pte against HF eager.

One export (``export.torchchat.exporter``: Meta-layout .pth + params.json, AOTInductor .pt2, ExecuTorch
.pte, all with max_seq_len 512), then every artifact and the eager fp32 model are measured by
the same code in this process (``export.verify`` through each runner, 2 threads) on the project's
reference text: perplexity over the first 4097 pydoc tokens in 512-token windows, logit parity
and top-1 agreement with eager on the first window, prefill of 128 and 512 prompt tokens from
offset 5000, and greedy decode speed over 64 steps after the 128-token prefill; median of
``--runs`` after one warm-up. The runners are the ones torchchat's paths use: the .pt2 through
``torch._inductor.aoti_load_package`` with int32 inputs, the .pte through ExecuTorch's pybindings.

    flock /tmp/heavy.lock .venv/bin/python bench/torchchat.py [--scheme fp32|8da8w|8da4w] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import failed_row  # noqa: E402
os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402

THREADS, PROMPT, LONG_PROMPT, DECODE, MAX_SEQ_LEN, EVAL_TOKENS = 2, 128, 512, 64, 512, 4096
LABELS = {"eager": "HF eager fp32", "pth": "model.pth (Meta-layout eager)", "pt2": "model.pt2 (AOTInductor)",
          "pte": "model.pte (ExecuTorch XNNPACK)"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def quantize(model, scheme: str):
    """The benchmark's quantized variants: all Linear layers; for 8da4w g32 the lm_head at 8da8w."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, PerGroup, quantize_

    w8 = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    if scheme == "8da8w":
        quantize_(model, w8)
    elif scheme == "8da4w":
        w4 = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
        quantize_(model, w4, lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
        quantize_(model, w8, lambda m, fqn: fqn == "lm_head")
    return model


def export(model, tokenizer, out: Path, calib, reuse: bool) -> dict:
    from export.base import get_exporter

    manifest = out / "manifest.json"
    if reuse and manifest.exists():
        log(f"reusing {out}")
        return json.loads((out / "bench_export.json").read_text())
    t0 = time.perf_counter()
    res = get_exporter("torchchat").export(model, tokenizer, out, {"max_seq_len": MAX_SEQ_LEN}, calibration=calib,
                                           log=log)
    timings = {"pth": res.details.get("export_s"), "pte": res.extra_details["pte"].get("export_s"),
               "pt2": res.extra_details["pt2"].get("export_s"), "total": round(time.perf_counter() - t0, 1),
               "probe": res.details.get("probe")}
    (out / "bench_export.json").write_text(json.dumps(timings))
    return timings


def prefill_ms(runner, ids, runs: int) -> float:
    times = []
    for i in range(runs + 1):
        runner.reset()
        t0 = time.perf_counter()
        runner.forward(ids, all_logits=False)
        if i:
            times.append((time.perf_counter() - t0) * 1000.0)
    runner.reset()
    return statistics.median(times)


def measure(runner, eager, eval_ids, prompt, runs: int) -> dict:
    from export.verify import latency, logits_parity, perplexity

    t0 = time.perf_counter()
    row = {"ppl": perplexity(runner, eval_ids, MAX_SEQ_LEN)["perplexity"]}
    if eager is not None:
        row.update(logits_parity(eager, runner, [eval_ids[: MAX_SEQ_LEN - 1]]))
    lat = latency(runner, prompt[:PROMPT], DECODE, runs=runs, warmup=1)
    row.update(prefill128_ms=lat["prefill_ms"], decode_tok_s=lat["decode_tok_s"],
               prefill512_ms=prefill_ms(runner, prompt[: LONG_PROMPT - 1], runs), measure_s=time.perf_counter() - t0)
    size = runner.size_bytes()
    row["size_mib"] = size / 2**20 if size else None
    return row


def _f(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def table(results: dict, timings: dict, scheme: str) -> str:
    eager = results.get("eager", {})
    lines = [f"| artifact ({scheme}) | size MiB | export s | perplexity | max abs logit diff vs eager | top-1 vs eager "
             "| prefill-128 ms | prefill-511 ms | decode tok/s | x eager prefill-128 | x eager decode |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in results.items():
        if "error" in r:
            lines.append(failed_row(LABELS[key], r["error"], 9, width=160))
            continue
        speed = [_f(eager.get("prefill128_ms", 0) / r["prefill128_ms"], ".2f") if eager else "-",
                 _f(r["decode_tok_s"] / eager["decode_tok_s"], ".2f") if eager.get("decode_tok_s") else "-"]
        lines.append(f"| {LABELS[key]} | {_f(r.get('size_mib'), '.0f')} | {_f(timings.get(key), '.0f')} "
                     f"| {r['ppl']:.3f} | {_f(r.get('max_abs_diff'), '.1e')} | {_f(r.get('top1_agreement'), '.4f')} "
                     f"| {r['prefill128_ms']:.0f} | {r['prefill512_ms']:.0f} | {r['decode_tok_s']:.1f} | "
                     + " | ".join(speed) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", choices=("fp32", "8da8w", "8da4w"), default="fp32",
                    help="quantize the model with torchao before the export (8da4w: g32, lm_head 8da8w)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_torchchat"), help="export directory root")
    ap.add_argument("--reuse", action="store_true", help="reuse an earlier export in --out/<scheme>")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median) after one warm-up")
    ap.add_argument("--output", type=Path, default=Path("/tmp/bench_torchchat.txt"), help="table (and .json beside it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)

    from export.base import get_exporter
    from export.executorch.runner import set_threads
    from export.decoding.runtime import EagerRunner
    from targets.sources.corpus import load_text, tokenize
    from targets.sources import BundledSource, load_model

    t_all = time.perf_counter()
    lm = load_model(BundledSource(name="smollm2-135m"))
    fp32 = lm.model.eval()
    ids = tokenize(load_text("pydoc"), lm.tokenizer)
    eval_ids, prompt = ids[: EVAL_TOKENS + 1], ids[5000 : 5000 + LONG_PROMPT]
    calib = [ids[EVAL_TOKENS + 1 : EVAL_TOKENS + 1 + 64]]
    model = fp32 if args.scheme == "fp32" else quantize(__import__("copy").deepcopy(fp32), args.scheme)
    out = args.out / args.scheme
    timings = export(model, lm.tokenizer, out, calib, args.reuse)
    log(f"export: {timings}")

    set_threads(THREADS)
    torch.set_num_threads(THREADS)
    eager = EagerRunner(fp32)
    results: dict[str, dict] = {}
    for key in ("eager", "pth", "pt2", "pte"):
        try:
            runner = eager if key == "eager" else get_exporter("torchchat").load(out / f"model.{key}")
            results[key] = measure(runner, None if key == "eager" else eager, eval_ids, prompt, args.runs)
            if key == "eager":
                results[key]["size_mib"] = sum(p.numel() * p.element_size() for p in fp32.parameters()) / 2**20
        except Exception as exc:  # one failing artifact must not lose the others
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"{key}: {json.dumps(results[key], default=str)}")
    text = (f"bench/torchchat.py: SmolLM2-135M ({args.scheme}), {THREADS} threads, max_seq_len {MAX_SEQ_LEN}; perplexity "
            f"over the first {EVAL_TOKENS + 1} pydoc tokens in {MAX_SEQ_LEN}-token windows; parity on the first window; "
            f"prompts from offset 5000; decode {DECODE} greedy steps after a {PROMPT}-token prefill; median of "
            f"{args.runs} after 1 warm-up, all through the same Python loop. Load avg {os.getloadavg()[0]:.1f} at the "
            "end: on a shared machine timings are noisy; compare ratios within one run.\n\n"
            + table(results, timings, args.scheme)
            + f"\n\nexport s: per artifact (the .pth includes writing the tokenizer and its Meta-layout probe); whole "
            f"export {timings.get('total')} s. Wall time of this run {time.perf_counter() - t_all:.0f} s.\n")
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    args.output.with_suffix(".json").write_text(json.dumps({"results": results, "export": timings}, indent=1,
                                                           default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
