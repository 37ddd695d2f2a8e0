"""Benchmark the rmsnorm and gqa rewrites (issue 5). Prints one table; also writes it to --out.

1. LN -> RMSNorm on a GPT-2-style model (random init from config, LayerNorm gammas/betas and
   biases perturbed so the fold is non-trivial): max logit difference and eager forward
   latency before/after.
2. GQA on the real SmolLM2-135M (9 query / 3 KV heads -> 1 KV head): perplexity by the
   reference method (first 4097 pydoc tokens, 512-token windows) before, after the rewrite
   and after a short distillation heal; KV-cache bytes per token; decode tok/s in ExecuTorch
   if ``export/executorch/exporter.py`` is available and --runtime allows it, else eager (noted).

    .venv/bin/python bench/rewrites.py --out /tmp/bench_rewrites.txt

Timings: median of --runs after warm-up, --threads OpenMP threads, on a shared CPU (noisy).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optimize.finetune import FinetuneConfig, finetune  # noqa: E402
from optimize.stage_api import StageContext, get_stage  # noqa: E402


def median_time(fn, runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fa, fb, runs: int, warmup: int = 2) -> tuple[float, float]:
    """Alternate A and B so drifting load from other processes hits both alike."""
    for _ in range(warmup):
        fa(), fb()
    ta, tb = [], []
    for _ in range(runs):
        for f, acc in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def perplexity(model, ids: torch.Tensor, window: int = 512) -> float:
    """The pipeline's own perplexity (export.verify: non-overlapping windows, summed NLL)."""
    from export.decoding.runtime import EagerRunner
    from export.verify import perplexity as runner_perplexity

    return runner_perplexity(EagerRunner(model), ids, window)["perplexity"]


def bench_rmsnorm(args, rows: list[tuple[str, str]]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from torch import nn

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt2", n_embd=768, n_layer=args.gpt2_layers, n_head=12, vocab_size=50257, n_positions=1024)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if isinstance(model.get_submodule(n.rpartition(".")[0]), nn.LayerNorm):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if n.endswith("weight") else 0.0))
            elif n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 50257, (1, args.seq_len), generator=torch.Generator().manual_seed(1))

    def fwd(m):
        with torch.inference_mode():
            return m(input_ids=ids).logits

    original = copy.deepcopy(model)
    ref = fwd(original)
    ctx = StageContext(tokenizer=None, calibration=[ids[0]], train_ids=ids[0], target=None, work_dir=Path(tempfile.mkdtemp()))
    spec = get_stage("rmsnorm")
    t0 = time.perf_counter()
    model = spec.fn(model, spec.config_cls.model_validate({"kind": "rmsnorm"}), ctx)
    rewrite_s = time.perf_counter() - t0
    diff = (fwd(model) - ref).abs().max().item()
    t_before, t_after = interleaved_medians(lambda: fwd(original), lambda: fwd(model), args.runs)
    label = f"GPT-2-style {args.gpt2_layers}L/768d/12h, vocab 50257, random init, seq {args.seq_len}"
    rows += [
        ("[rmsnorm] model", label),
        ("[rmsnorm] LayerNorms -> RMSNorm", f"{ctx.details['norms_replaced']} (exact fold, {rewrite_s:.1f} s)"),
        ("[rmsnorm] max |logit diff| fp32", f"{diff:.2e} (logit scale max |logit| {ref.abs().max().item():.2f})"),
        ("[rmsnorm] eager forward before", f"{t_before * 1e3:.1f} ms"),
        ("[rmsnorm] eager forward after", f"{t_after * 1e3:.1f} ms ({t_after / t_before:.2f}x)"),
    ]


def decode_tok_s(runner, prompt: torch.Tensor, new_tokens: int, runs: int) -> float:
    """Greedy decode speed after an untimed prefill: median over runs of tokens / decode seconds."""
    rates = []
    for i in range(runs + 1):  # the first run is the warm-up
        runner.reset()
        logits = runner.forward(prompt, all_logits=False)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            nxt = torch.argmax(logits[-1]).reshape(1)
            logits = runner.forward(nxt, all_logits=False)
        if i:
            rates.append(new_tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def make_runner(model, tokenizer, kind: str, tmp: Path, log, args_max_seq: int = 256):
    """An ExecuTorch runner if asked and available, else eager. Returns (runner, label)."""
    if kind in ("auto", "executorch") and (ROOT / "export" / "executorch.py").exists():
        try:
            from export import get_exporter

            exp = get_exporter("executorch")
            t0 = time.perf_counter()
            tmp.mkdir(parents=True, exist_ok=True)
            opts = exp.options_model(max_seq_len=args_max_seq)
            res = exp.export(model, tokenizer, tmp, opts, log=log)
            log(f"executorch export took {time.perf_counter() - t0:.0f} s")
            return exp.load(res.artifact), "executorch"
        except Exception as exc:  # noqa: BLE001 - the bench falls back and says why
            if kind == "executorch":
                raise
            log(f"executorch unavailable ({type(exc).__name__}: {str(exc)[:200]}); using eager")
    from export.decoding.runtime import EagerRunner

    return EagerRunner(model), "eager (HF DynamicCache)"


def bench_gqa(args, rows: list[tuple[str, str]]) -> None:
    from targets.sources.corpus import load_text, split_corpus, tokenize
    from targets.sources import BundledSource, load_model

    loaded = load_model(BundledSource(name="smollm2-135m"))
    base = loaded.model
    splits = split_corpus(tokenize(load_text("pydoc"), loaded.tokenizer), eval_tokens=4096, calib_tokens=2048)
    ppl_base = perplexity(base, splits.eval_ids)
    model = copy.deepcopy(base)
    ctx = StageContext(tokenizer=loaded.tokenizer, calibration=[splits.calib_ids], train_ids=splits.train_ids,
                       target=None, work_dir=Path(tempfile.mkdtemp()), seed=0)
    spec = get_stage("gqa")
    model = spec.fn(model, spec.config_cls.model_validate({"kind": "gqa", "num_key_value_heads": 1}), ctx)
    ppl_gqa = perplexity(model, splits.eval_ids)
    hcfg = FinetuneConfig(loss="distill", steps=args.heal_steps, optimizer={"lr": args.heal_lr, "betas": (0.9, 0.999)},
                          seq_len=args.heal_seq_len, batch={"micro_batch_size": args.heal_batch},
                          schedule={"warmup_steps": min(5, args.heal_steps // 5), "decay": "constant"}, progress=True)
    facts = finetune(model, hcfg, splits.train_ids, teacher=base, seed=0, who="heal", log=print)
    ppl_healed = perplexity(model, splits.eval_ids)
    d = ctx.details
    rows += [
        ("[gqa] model", "SmolLM2-135M-Instruct (de-quantized Q4_1), 9 query heads, 30 layers, fp32"),
        ("[gqa] KV heads", f"{d['kv_heads_before']} -> {d['kv_heads_after']} (init mean)"),
        ("[gqa] KV cache bytes/token fp32", f"{d['kv_cache_bytes_per_token_before']} -> {d['kv_cache_bytes_per_token_after']}"
                                            f" ({d['kv_cache_bytes_per_token_before'] / d['kv_cache_bytes_per_token_after']:.0f}x smaller)"),
        ("[gqa] KV cache at 2048 tokens", f"{d['kv_cache_bytes_per_token_before'] * 2048 / 2**20:.1f} MiB -> "
                                          f"{d['kv_cache_bytes_per_token_after'] * 2048 / 2**20:.1f} MiB"),
        ("[gqa] perplexity baseline (ref 14.71)", f"{ppl_base:.2f}"),
        ("[gqa] perplexity after GQA, no heal", f"{ppl_gqa:.2f}"),
        ("[gqa] perplexity after heal", f"{ppl_healed:.2f} (distill KL, {hcfg.steps} steps x {hcfg.batch.micro_batch_size}x"
                                         f"{hcfg.seq_len} tok = {facts['tokens_seen']} tokens, "
                                         f"lr {hcfg.optimizer.lr}, {facts['wall_s']:.0f} s)"),
        ("[gqa] heal KL first -> last step", f"{facts['loss_first']:.3f} -> {facts['loss_last']:.3f} (first5/last5 means "
                                             f"{facts['loss_first5_mean']:.3f} -> {facts['loss_last5_mean']:.3f})"),
    ]
    all_ids = tokenize(load_text("pydoc"), loaded.tokenizer)
    prompt = all_ids[5000 : 5000 + args.prompt_tokens]
    tmp = Path(tempfile.mkdtemp())
    for label, m in (("baseline", base), ("gqa 1 KV head (healed)", model)):
        runner, kind = make_runner(m, loaded.tokenizer, args.runtime, tmp / label.split()[0], print,
                                   args.prompt_tokens + args.new_tokens + 8)
        tps = decode_tok_s(runner, prompt, args.new_tokens, args.decode_runs)
        rows.append((f"[gqa] decode tok/s {label}", f"{tps:.1f} ({kind}; prompt {args.prompt_tokens}, {args.new_tokens} new)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="timed runs (median) after warm-up")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per forward for the GPT-2 latency")
    ap.add_argument("--gpt2-layers", type=int, default=6)
    ap.add_argument("--heal-steps", type=int, default=60)
    ap.add_argument("--heal-lr", type=float, default=1e-4)
    ap.add_argument("--heal-seq-len", type=int, default=256)
    ap.add_argument("--heal-batch", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-runs", type=int, default=3, help="timed decode runs (median) after one warm-up")
    ap.add_argument("--runtime", choices=["auto", "executorch", "eager"], default="auto")
    ap.add_argument("--only", choices=["rmsnorm", "gqa"], default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    if args.only in (None, "rmsnorm"):
        bench_rmsnorm(args, rows)
    if args.only in (None, "gqa"):
        bench_gqa(args, rows)
    width = max(len(k) for k, _ in rows)
    lines = [f"bench/rewrites.py  torch {torch.__version__}, threads {args.threads} (shared 2-core CPU: timings are noisy)",
             "-" * (width + 40)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append(f"total wall {time.perf_counter() - t0:.0f} s")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
