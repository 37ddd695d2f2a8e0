"""Benchmark the ExecuTorch target on SmolLM2-135M: speed, size and perplexity per scheme.

One run prints one table: HF eager fp32 (``generate`` and the same Runner-based latency the
.pte rows use), then fp32 / 8da8w / 8da4w / 8da4w with a higher-precision lm_head .pte
files measured through ExecuTorch's runtime with 2 threads. Perplexity follows the
project's reference method (first 4097 pydoc tokens, 512-token windows, no cache carried
between windows). Decode is also shown as a fraction of a memory-bandwidth ceiling measured
in the same run (a large tensor copy; weights read per token = .pte size minus the
embedding table, which is only gathered, not streamed).

Exports are cached under ``--work-dir`` by their options, so a re-run only measures.

    .venv/bin/python bench/executorch.py [--lm-head 8da8w] [--variants fp32,8da4w] [--work-dir /tmp/bench_et]
    .venv/bin/python bench/executorch.py --export-only 8da4w   # fill the cache (can run in parallel)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's folder would come first on sys.path and its name would shadow
# the real ``executorch`` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402

THREADS = 2
PROMPT_TOKENS = 128
DECODE_TOKENS = 64
MAX_SEQ_LEN = 512


def variants(lm_head: str) -> dict[str, dict]:
    out = {
        "fp32": {"quantize": "none"},
        "8da8w": {"quantize": "8da8w"},
        "8da4w": {"quantize": "8da4w", "group_size": 32},
    }
    if lm_head != "same":
        out[f"8da4w+head_{lm_head}"] = {"quantize": "8da4w", "group_size": 32, "lm_head": lm_head}
    for opts in out.values():
        opts["max_seq_len"] = MAX_SEQ_LEN
    return out


def export_cached(name: str, opts: dict, work: Path, model, tokenizer) -> Path:
    from export.executorch import ExecuTorchExporter

    key = hashlib.sha256(json.dumps(opts, sort_keys=True).encode()).hexdigest()[:10]
    out = work / f"{name}-{key}"
    if (out / "manifest.json").exists():
        return out / "model.pte"
    t0 = time.perf_counter()
    res = ExecuTorchExporter().export(model, tokenizer, out, opts, log=lambda m: print(f"  [{name}] {m}", file=sys.stderr))
    print(f"  [{name}] exported in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return res.artifact


def copy_bandwidth(nbytes: int = 512 << 20, runs: int = 7) -> float:
    """Read+write traffic of a large tensor copy, bytes/s (median)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def eager_generate_tok_s(model, prompt: torch.Tensor, runs: int = 3) -> float:
    """HF generate, greedy, fixed length; decode speed = new tokens / (total - prefill)."""
    ids = prompt.reshape(1, -1)
    kw = dict(do_sample=False, max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        speeds = []
        for _ in range(runs):
            t0 = time.perf_counter()
            model(ids)
            t1 = time.perf_counter()
            model.generate(ids, **kw)
            t2 = time.perf_counter()
            speeds.append((DECODE_TOKENS - 1) / ((t2 - t1) - (t1 - t0)))
    return statistics.median(speeds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-head", choices=["same", "fp32", "8da8w"], default="8da8w",
                    help="extra 8da4w row with lm_head kept at this precision (same = no extra row)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_et"))
    ap.add_argument("--export-only", metavar="VARIANT", help="only export this variant (to prepare the cache in parallel)")
    ap.add_argument("--variants", help="comma-separated subset of: fp32, 8da8w, 8da4w, 8da4w+head_<lm-head> (default all)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=4096,
                    help="perplexity targets (4096 = the reference; fewer only to save time, and say so)")
    args = ap.parse_args()

    torch.set_num_threads(THREADS)
    from export.executorch_runtime import set_threads
    from export.runtime import EagerRunner
    from export.verify import latency, perplexity
    from train.corpus import load_text, tokenize
    from train.sources import BundledSource, load_model

    loaded = load_model(BundledSource(name="smollm2-135m"))
    model, tok = loaded.model.eval(), loaded.tokenizer
    vs = variants(args.lm_head)
    if args.variants:
        wanted = [v.strip() for v in args.variants.split(",")]
        unknown = [v for v in wanted if v not in vs]
        if unknown:
            ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(vs)}")
        vs = {k: vs[k] for k in wanted}
    if args.export_only:
        export_cached(args.export_only, vs[args.export_only], args.work_dir, model, tok)
        return
    ptes = {name: export_cached(name, opts, args.work_dir, model, tok) for name, opts in vs.items()}

    ids = tokenize(load_text("pydoc"), tok)
    eval_ids, prompt = ids[: args.eval_tokens + 1], ids[5000 : 5000 + PROMPT_TOKENS]
    set_threads(THREADS)
    bw = copy_bandwidth()
    cfg = model.config
    emb_bytes = cfg.vocab_size * cfg.hidden_size * 4

    rows = []
    eager = EagerRunner(model)
    lat = latency(eager, prompt, DECODE_TOKENS, runs=args.runs, warmup=1)
    gen = eager_generate_tok_s(model, prompt, runs=args.runs)
    ppl = perplexity(eager, eval_ids, MAX_SEQ_LEN)["perplexity"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: lm_head == embedding
    rows.append(("eager fp32 (HF generate)", None, None, gen, ppl, weight_bytes))
    rows.append(("eager fp32 (Runner)", None, lat["prefill_ms"], lat["decode_tok_s"], ppl, weight_bytes))
    del eager

    from export.executorch import ExecuTorchExporter

    for name, pte in ptes.items():
        runner = ExecuTorchExporter().load(pte, threads=THREADS)
        lat = latency(runner, prompt, DECODE_TOKENS, runs=args.runs, warmup=1)
        ppl = perplexity(runner, eval_ids, MAX_SEQ_LEN)["perplexity"]
        size = runner.size_bytes()
        rows.append((f".pte {name}", size, lat["prefill_ms"], lat["decode_tok_s"], ppl, size - emb_bytes))
        del runner

    base_tok_s, base_ppl = rows[0][3], rows[0][4]
    print(f"SmolLM2-135M on ExecuTorch/XNNPACK, {THREADS} threads, prompt {PROMPT_TOKENS}, decode {DECODE_TOKENS}, "
          f"median of {args.runs} after 1 warm-up; max_seq_len {MAX_SEQ_LEN}")
    print(f"copy bandwidth (read+write of a 512 MiB copy): {bw / 1e9:.1f} GB/s")
    print(f"perplexity: first {args.eval_tokens + 1} pydoc tokens, windows of 512 inputs each from a clean cache "
          "(the .pte takes each window as a 511-token prefill + 1 token: one dynamic-shape call holds max_seq_len-1)")
    hdr = f"{'model':<28}{'size MB':>9}{'prefill ms':>11}{'decode tok/s':>13}{'x eager':>8}{'ppl':>8}{'ppl vs fp32':>12}{'ceiling tok/s':>14}{'of ceiling':>11}"
    print(hdr)
    print("-" * len(hdr))
    for name, size, pre, dec, ppl, wbytes in rows:
        ceiling = bw / wbytes
        print(f"{name:<28}{(f'{size / 1e6:.1f}' if size else '-'):>9}{(f'{pre:.0f}' if pre else '-'):>11}"
              f"{dec:>13.1f}{dec / base_tok_s:>8.2f}{ppl:>8.2f}{(ppl / base_ppl - 1) * 100:>+11.1f}%"
              f"{ceiling:>14.0f}{dec / ceiling:>11.0%}")
    print("x eager: decode vs HF eager fp32 generate. ceiling = copy bandwidth / weight bytes read per token "
          "(.pte size minus the fp32 embedding table; eager: all parameters, lm_head tied).")
    print("The machine's 2 cores are shared with other jobs: timings are noisy.")


if __name__ == "__main__":
    main()
