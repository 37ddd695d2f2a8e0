"""Benchmark our ExecuTorch .pte files of SmolLM2-135M against optimum-executorch's, in one run.

Rows: ours fp32, ours 8da8w, ours 8da4w with the demo recipe (the stages and export options of
``examples/smollm2.yaml``: AWQ + GPTQ, lm_head 8da8w), the same with lm_head at 4 bits too
(``all4``: the peer's bytes per token) and, with ``--with-optimum``, the peer's
8da4w .pte (optimum-executorch 1.1.0, ``--use_custom_sdpa --use_custom_kv_cache --qlinear 8da4w``),
plus the decode ceilings from a copy bandwidth measured in the same run.

Every .pte is measured by the same code in this process (``export.verify`` through
:class:`~export.executorch.runner.ExecuTorchRunner`, ``forward(tokens[1, T], input_pos)`` from
Python, 2 threads) on the same text: the project's reference (perplexity over the first 4097
pydoc tokens in 512-token windows; prompts from offset 5000; median of ``--runs`` after a
warm-up). ExecuTorch's own C++ text runner (TextLLMRunner) is timed on the same prompt too.

optimum-executorch pins transformers==5.0.0rc1, so it lives in a venv of its own (built once
under the cache dir, torch held at 2.13.0, executorch at ours) and is only ever run through
``optimum-cli``. Exports (ours and the peer's) are cached under ``--cache-dir`` by what
determines their bytes, so a re-run only measures.

    flock /tmp/heavy.lock .venv/bin/python bench/executorch.py --with-optimum [--rows fp32,8da8w,demo,peer]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# As a script this folder comes first on sys.path and this file's name would shadow the real
# ``executorch`` package; the repository root goes there instead (for bench.accuracy's helpers).
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import failed_row  # noqa: E402
os.environ.setdefault("OMP_NUM_THREADS", "2")
# before torch loads: MKL serial on ExecuTorch's workers (export/executorch/blas_threads.py); main() sets torch's threads
os.environ.setdefault("MKL_NUM_THREADS", "1")
import torch  # noqa: E402

THREADS = 2
PROMPT, LONG_PROMPT, DECODE = 128, 512, 64
MAX_SEQ_LEN = 512
EVAL_TOKENS = 4096
DEMO_YAML = HERE.parent / "examples" / "smollm2.yaml"
PEER = {"optimum-executorch": "1.1.0", "executorch": "1.5.1", "torchao": "0.18.0", "transformers": "5.0.0rc1"}
PEER_CMD = ["export", "executorch", "--task", "text-generation", "--recipe", "xnnpack", "--use_custom_sdpa",
            "--use_custom_kv_cache", "--max_seq_len", str(MAX_SEQ_LEN), "--qlinear", "8da4w"]
ROWS = {
    "fp32": "ours fp32",
    "8da8w": "ours 8da8w (all Linear)",
    "demo": "ours 8da4w demo (AWQ+GPTQ, lm_head 8da8w)",
    "all4": "ours 8da4w, lm_head 4-bit too (AWQ+GPTQ)",
    "peer": "optimum-executorch 8da4w",
}
#: files under export/ that only load or measure programs: editing them does not change a .pte
#: (export/decoding/, the decoding loops, is not read at all)
RUNTIME_ONLY = {"executorch/runner.py", "executorch/llm_runner.py", "executorch/blas_threads.py", "verify.py"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# our exports


def our_recipes() -> dict[str, tuple[list[dict], dict]]:
    """Row -> (stages, ExecuTorch export options); the demo row reads examples/smollm2.yaml."""
    import yaml

    demo = yaml.safe_load(DEMO_YAML.read_text())
    demo_export = {**demo.get("export", {}).get("executorch", {}), "max_seq_len": MAX_SEQ_LEN}
    # the demo with the output projection at 4 bits as well (GPTQ on it too): the peer's bytes per token
    all4 = [{**st, "int8_modules": []} if st.get("kind") == "ptq_int8" else st for st in demo["stages"]]
    return {
        "fp32": ([], {"quantize": "none", "max_seq_len": MAX_SEQ_LEN}),
        "8da8w": ([], {"quantize": "8da8w", "lm_head": "same", "max_seq_len": MAX_SEQ_LEN}),
        "demo": (demo["stages"], demo_export),
        "all4": (all4, demo_export),
    }


def _code_digest(stages: list[dict]) -> str:
    """The exporter's code (and the stages' when there are stages), runtime-only files left out."""
    root = HERE.parent
    export_dir = root / "export"  # the shared floor and the ExecuTorch package, not the other runtimes
    files = [f for f in sorted([*export_dir.glob("*.py"), *(export_dir / "executorch").glob("*.py")])
             if f.relative_to(export_dir).as_posix() not in RUNTIME_ONLY]
    if stages:
        files += sorted((root / "optimize").rglob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def export_ours(name: str, stages: list[dict], opts: dict, lm, calib, cache: Path) -> tuple[Path, dict]:
    """Our .pte for a row (cached by stages, options, toolchain and code); returns (path, timings)."""
    from bench.accuracy import Row, _prepare
    from export.executorch.exporter import ExecuTorchExporter
    from optimize.export_cache import toolchain_versions

    calib_tokens = sum(int(w.numel()) for w in calib) if stages else 0  # the stages' calibration text
    key = hashlib.sha256(json.dumps({"stages": stages, "opts": opts, "toolchain": toolchain_versions(),
                                     "code": _code_digest(stages), "calib_tokens": calib_tokens},
                                    sort_keys=True).encode()).hexdigest()[:12]
    out = cache / f"ours-{name}-{key}"
    meta = out / "bench.json"
    if (out / "manifest.json").exists() and meta.exists():
        log(f"{name}: reusing {out}")
        return out / "model.pte", {**json.loads(meta.read_text()), "cached": True}
    import copy

    t0 = time.perf_counter()
    model, _ = _prepare(copy.deepcopy(lm.model).eval(), Row(name, "executorch", stages, opts), calib, lm.tokenizer,
                        cache / "stage-work", log)
    stages_s = time.perf_counter() - t0
    log(f"{name}: exporting (stages took {stages_s:.0f}s)")
    t0 = time.perf_counter()
    res = ExecuTorchExporter().export(model, lm.tokenizer, out, opts, log=lambda m: log(f"{name}: {m}"))
    timings = {"stages_s": round(stages_s, 1), "export_s": round(time.perf_counter() - t0, 1),
               "exporter": res.details.get("timings", {}), "delegation": res.details.get("delegation", {})}
    meta.write_text(json.dumps(timings, indent=1))
    return res.artifact, timings


# ---------------------------------------------------------------------------------------------
# the peer


def peer_venv(venv: Path) -> Path:
    """A venv of its own for optimum-executorch (it pins transformers==5.0.0rc1), built once.
    torch is installed first (2.13.0 is a CPU wheel on disk) and held there by a constraint."""
    py = venv / "bin" / "python"
    if (venv / ".ok").exists():
        return py
    log(f"building the optimum-executorch venv at {venv} (one time, a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")
    subprocess.run(pip + ["-c", str(constraints)] + [f"{k}=={v}" for k, v in PEER.items()], check=True)
    check = subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True)
    freeze = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    (venv / ".ok").write_text(json.dumps({"pip_check": check.stdout.strip(), "freeze": freeze.splitlines()}, indent=1))
    if check.returncode:
        log(f"optimum-executorch venv: pip check reports: {check.stdout.strip()}")
    return py


def export_peer(hf_dir: Path, cache: Path) -> tuple[Path, dict]:
    """The peer's 8da4w .pte through ``optimum-cli`` in its venv (cached); returns (path, timings)."""
    venv = cache / "optimum-executorch-venv"
    key = hashlib.sha256(json.dumps({"peer": PEER, "cmd": PEER_CMD, "model": str(hf_dir)}).encode()).hexdigest()[:12]
    out = cache / f"peer-8da4w-{key}"
    meta = out / "bench.json"
    if (out / "model.pte").exists() and meta.exists():
        log(f"peer: reusing {out}")
        return out / "model.pte", {**json.loads(meta.read_text()), "cached": True}
    peer_venv(venv)  # builds it once; the export runs its optimum-cli
    tmp = out.with_name(out.name + ".partial")
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    log("peer: optimum-cli export executorch ... --qlinear 8da4w (about 6 minutes)")
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "MKL_NUM_THREADS"}  # the peer exports as a user runs it
    env["OMP_NUM_THREADS"] = str(THREADS)
    res = subprocess.run([str(venv / "bin" / "optimum-cli"), *PEER_CMD, "--model", str(hf_dir), "--output_dir", str(tmp)],
                         capture_output=True, text=True, env=env)
    export_s = time.perf_counter() - t0
    if res.returncode != 0 or not (tmp / "model.pte").exists():
        raise RuntimeError(f"optimum-cli export failed (exit {res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # what ExecuTorch's C++ runner reads beside the .pte
        if (hf_dir / f).exists():
            (tmp / f).write_bytes((hf_dir / f).read_bytes())
    versions = {line.split("==")[0]: line.split("==")[1] for line in json.loads((venv / ".ok").read_text())["freeze"]
                if "==" in line and line.split("==")[0] in ("torch", "executorch", "torchao", "transformers",
                                                            "optimum-executorch", "optimum")}
    timings = {"export_s": round(export_s, 1), "versions": versions}
    (tmp / "bench.json").write_text(json.dumps(timings, indent=1))
    tmp.rename(out)
    return out / "model.pte", timings


# ---------------------------------------------------------------------------------------------
# measurement


def copy_bandwidth(nbytes: int = 512 << 20, runs: int = 7) -> float:
    """Read+write traffic of a large tensor copy, bytes/s (median): the ``host`` device profile's
    measure (:func:`targets.devices.copy_bandwidth`), on a larger tensor and more runs."""
    from targets.devices import copy_bandwidth as measure

    return measure(nbytes, runs)


def read_rate(nbytes: int, runs: int = 9) -> float:
    """Bytes/s of summing a float32 buffer of ``nbytes`` with this process's threads (median): what a
    decode step that reads that many bytes of weights could reach here. Unlike the 512 MiB copy, a
    buffer the size of a quantized model may stay in a large last-level cache between reads."""
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times)


def l3_cache() -> str:
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return "unknown"


def ceilings(model, bandwidth: float) -> dict[str, dict]:
    """Decode ceilings: bandwidth / Linear weight bytes read per token (lm_head counted in full),
    with the project's size model (optimize.quant.mixed: int4 g32 = 0.5 B + fp32 scale + int8 zero
    per group, int8 = 1 B + per-channel scale). KV-cache reads are not counted."""
    from torch import nn

    from optimize.quant.mixed import decode_bytes

    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    head = {n for n in linear if n == "lm_head" or n.endswith(".lm_head")}
    per_token = {
        "fp32": decode_bytes(model, set(), 4, 32),
        "int8": decode_bytes(model, set(), 8, None, int8=linear),
        "4-bit g32": decode_bytes(model, linear, 4, 32),
        "4-bit g32, lm_head int8": decode_bytes(model, linear - head, 4, 32, int8=head),
    }
    out = {}
    for k, b in per_token.items():
        rate = read_rate(int(b))
        out[k] = {"bytes_per_token": b, "tok_s": bandwidth / b, "read_gb_s": rate / 1e9, "read_tok_s": rate / b}
    return out


ROW_CEILING = {"fp32": "fp32", "8da8w": "int8", "demo": "4-bit g32, lm_head int8", "all4": "4-bit g32",
               "peer": "4-bit g32"}


def measure(pte: Path, eval_ids, prompt, tokenizer, runs: int) -> dict:
    from bench.retiming import prefill_ms
    from export.executorch.llm_runner import LLMRunnerUnavailable
    from export.executorch.runner import ExecuTorchRunner
    from export.verify import latency, perplexity

    runner = ExecuTorchRunner(pte, threads=THREADS)
    t0 = time.perf_counter()
    ppl = perplexity(runner, eval_ids, MAX_SEQ_LEN)["perplexity"]
    row = {"size_mib": runner.size_bytes() / 2**20, "ppl": ppl, "ppl_s": round(time.perf_counter() - t0, 1)}
    lat = latency(runner, prompt[:PROMPT], DECODE, runs=runs, warmup=1)
    row.update(prefill128_ms=lat["prefill_ms"], decode_tok_s=lat["decode_tok_s"],
               prefill512_ms=prefill_ms(runner, prompt[:LONG_PROMPT], runs))
    try:  # ExecuTorch's C++ runner on the same prompt (tokenized by its own tokenizer)
        llm = runner.llm_runner()
        text, num_bos = llm.prompt_for(tokenizer, prompt[:PROMPT].tolist(), strict=False)
        st = llm.timed(text, DECODE, num_bos=num_bos, runs=runs, warmup=1)
        row.update(cpp_prefill128_ms=st["prefill_ms"], cpp_decode_tok_s=st["decode_tok_s"],
                   cpp_prompt_tokens=st["prompt_tokens"], cpp_generated=st["generated_tokens"])
    except LLMRunnerUnavailable as exc:
        row["cpp_error"] = str(exc)
        log(f"{pte}: C++ runner not timed: {exc}")
    row["runtime"] = {k: v for k, v in runner.describe().items() if k in ("max_prefill_chunk", "input_pos",
                                                                         "all_position_logits", "threads")}
    return row


def retime(results: dict[str, dict], ptes: dict, prompt, rounds: int, tokenizer) -> dict:
    """Time prefill-128, prefill-512 and decode again for every row, round-robin
    (:mod:`bench.retiming`), through the Python loop and ExecuTorch's C++ runner: the speed columns
    become the medians over rounds, and the ratios against the peer are paired within each round.
    Returns the host's load and steal."""
    from bench.retiming import HostMonitor, round_robin, summarize

    keys = [k for k in results if "error" not in results[k]]
    mon = HostMonitor()
    samples = round_robin({k: ptes[k][0] for k in keys}, prompt[:PROMPT], DECODE, rounds, THREADS,
                          long_prompt=prompt[:LONG_PROMPT], log=log, tokenizer=tokenizer)
    for key, row in summarize(samples, reference="peer" if "peer" in keys else None).items():
        results[key].update(row)
    return mon.report()


# ---------------------------------------------------------------------------------------------
# table


def samples_text(results: dict[str, dict], host: dict | None) -> str:
    """Each row's decode samples over the timing rounds, and the host's load and steal while
    they were taken (a loaded host slows 2-thread XNNPACK kernels several-fold)."""
    rows = {k: r for k, r in results.items() if r.get("decode_samples")}
    if not rows:
        return ""
    lines = ["", "Decode tok/s over the round-robin passes (median; best; samples):"]
    for key, r in rows.items():
        lines.append(f"- {ROWS[key]}: {r['decode_tok_s']:.1f}; {r['decode_best']:.1f} ({r['decode_samples']})"
                     + (f"; C++ runner {r['cpp_decode_samples']}" if r.get("cpp_decode_samples") else ""))
    if host:
        lines.append(f"Host while timing: load average {host['load_avg_start']} -> {host['load_avg_end']}, "
                     f"CPU steal {host['steal_pct']}%.")
    return "\n".join(lines) + "\n"


def _f(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def table(results: dict[str, dict], ceil: dict[str, dict], bandwidth: float) -> str:
    peer = results.get("peer") if "error" not in results.get("peer", {"error": 1}) else None
    lines = ["| row | size MiB | prefill-128 ms | prefill-512 ms | decode tok/s | of ceiling | ppl | export s "
             "| C++ runner prefill-128 ms / decode tok/s | x peer prefill-128 | x peer prefill-512 | x peer decode "
             "| x peer C++ runner decode | x peer size |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in results.items():
        if "error" in r:
            lines.append(failed_row(ROWS[key], r["error"], 12))
            continue
        c = ceil[ROW_CEILING[key]]["tok_s"]
        exp = r.get("export", {})
        export_s = (exp.get("export_s") or 0) + (exp.get("stages_s") or 0)
        export_txt = _f(export_s, ".0f") + (f" ({exp['stages_s']:.0f} stages)" if exp.get("stages_s") else "") \
            + (" cached" if exp.get("cached") else "")
        ratios = ["-"] * 5
        if peer:
            # paired within each timing round when re-timed (robust to the host's drift), else of medians
            paired = r.get("paired_x_ref") or {}
            ratios = [_f(paired.get("prefill128", r["prefill128_ms"] / peer["prefill128_ms"]), ".2f"),
                      _f(paired.get("prefill512", r["prefill512_ms"] / peer["prefill512_ms"]), ".2f"),
                      _f(paired.get("decode", r["decode_tok_s"] / peer["decode_tok_s"]), ".2f"),
                      _f(paired.get("cpp_decode"), ".2f"),
                      _f(r["size_mib"] / peer["size_mib"], ".2f")]
        cpp = f"{_f(r.get('cpp_prefill128_ms'), '.0f')} / {_f(r.get('cpp_decode_tok_s'), '.1f')}"
        lines.append(f"| {ROWS[key]} | {r['size_mib']:.0f} | {r['prefill128_ms']:.0f} | {r['prefill512_ms']:.0f} "
                     f"| {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / c:.0%} of {c:.0f} | {r['ppl']:.2f} "
                     f"| {export_txt} | {cpp} | " + " | ".join(ratios) + " |")
    lines.append("")
    lines.append(f"Copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write of a 512 MiB copy, median of 7). Decode ceilings "
                 "(bandwidth / Linear weight bytes per token, the full lm_head counted): " + ", ".join(
                     f"{k} {v['tok_s']:.0f} tok/s ({v['bytes_per_token'] / 1e6:.0f} MB)" for k, v in ceil.items()) + ".")
    lines.append(f"Reading a buffer of those bytes (a float32 sum, {THREADS} threads; L3 {l3_cache()}) instead: "
                 + ", ".join(f"{k} {v['read_tok_s']:.0f} tok/s ({v['read_gb_s']:.0f} GB/s)" for k, v in ceil.items())
                 + f". MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')} (export/executorch/blas_threads.py).")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help=f"comma-separated subset of {', '.join(ROWS)} (default: ours, "
                    "plus peer with --with-optimum)")
    ap.add_argument("--with-optimum", action="store_true", help="build optimum-executorch in its own venv and add "
                    "its 8da4w .pte (the peer row)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/bench_executorch"),
                    help="exports and the peer's venv, reused across runs")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median) after one warm-up")
    ap.add_argument("--rounds", type=int, default=5, help="then this many round-robin passes over every row; the "
                    "speed columns are their medians (0: keep each row's own median of --runs)")
    ap.add_argument("--output", type=Path, default=Path("/tmp/bench_executorch.txt"), help="table (and .json beside it)")
    ap.add_argument("--export-only", action="store_true", help="fill the export cache, measure nothing")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",")] if args.rows else \
        ["fp32", "8da8w", "demo", "all4"] + (["peer"] if args.with_optimum else [])
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if "peer" in rows and not args.with_optimum:
        ap.error("the peer row needs --with-optimum")
    torch.set_num_threads(THREADS)
    args.cache_dir.mkdir(parents=True, exist_ok=True)

    from export.executorch.runner import set_threads
    from targets.sources.corpus import load_text, split_corpus, tokenize
    from targets.sources.corpus import windows as cut
    from targets.sources import BundledSource, bundled_gguf_path, convert_gguf, load_model

    t_all = time.perf_counter()
    lm = load_model(BundledSource(name="smollm2-135m"))
    ids = tokenize(load_text("pydoc"), lm.tokenizer)
    from optimize.config import load_config

    data = load_config(DEMO_YAML, check_files=False).data  # the demo's calibration text, read as the pipeline does
    splits = split_corpus(ids, eval_tokens=EVAL_TOKENS, calib_tokens=data.calibration_tokens)
    calib = cut(splits.calib_ids, data.seq_len)
    eval_ids, prompt = ids[: EVAL_TOKENS + 1], ids[5000 : 5000 + LONG_PROMPT]

    ptes: dict[str, tuple[Path, dict]] = {}
    results: dict[str, dict] = {}
    recipes = our_recipes()
    for key in rows:
        try:
            if key == "peer":
                ptes[key] = export_peer(convert_gguf(bundled_gguf_path("smollm2-135m")), args.cache_dir)
            else:
                ptes[key] = export_ours(key, *recipes[key], lm, calib, args.cache_dir)
        except Exception as exc:  # one failing row must not lose the others
            log(f"{key}: export failed: {type(exc).__name__}: {exc}")
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
    if args.export_only:
        return 0

    set_threads(THREADS)
    bandwidth = copy_bandwidth()
    ceil = ceilings(lm.model, bandwidth)
    log(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; load avg {os.getloadavg()[0]:.1f}")
    for key in rows:
        if key in results:
            continue
        pte, timings = ptes[key]
        log(f"{key}: measuring {pte}")
        try:
            results[key] = {**measure(pte, eval_ids, prompt, lm.tokenizer, args.runs), "export": timings,
                            "artifact": str(pte)}
        except Exception as exc:
            log(f"{key}: measurement failed: {type(exc).__name__}: {exc}")
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"{key}: {json.dumps({k: v for k, v in results[key].items() if k != 'export'}, default=str)}")
    results = {k: results[k] for k in rows}
    host = retime(results, ptes, prompt, args.rounds, lm.tokenizer) if args.rounds else None

    text = (f"bench/executorch.py: SmolLM2-135M, {THREADS} threads, max_seq_len {MAX_SEQ_LEN}; perplexity over the first "
            f"{EVAL_TOKENS + 1} pydoc tokens in {MAX_SEQ_LEN}-token windows; prompts from offset 5000; decode "
            f"{DECODE} greedy steps after a {PROMPT}-token prefill; "
            + (f"median of {args.rounds} round-robin passes over all rows (1 warm-up each)" if args.rounds
               else f"median of {args.runs} after 1 warm-up")
            + ", all .pte "
            f"files through the same Python loop (ExecuTorch pybindings). Load avg {os.getloadavg()[0]:.1f} at the end: "
            "on a shared machine the timings are noisy; compare ratios within one run.\n\n"
            + table(results, ceil, bandwidth)
            + "\n\nx peer: ours / the peer's, the median over timing rounds of the ratio within each round (prefill: "
            "lower is better; decode: higher). export s: "
            "ExecuTorch export (quantize + torch.export + lowering), plus the stages it needs (AWQ, GPTQ); the peer's is "
            f"optimum-cli's wall time. C++ runner: ExecuTorch's TextLLMRunner's own Stats on the same prompt, timed in "
            "the same rounds (medians; x peer paired within each round). "
            f"Wall time of this run {time.perf_counter() - t_all:.0f} s.\n"
            + samples_text(results, host))
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    args.output.with_suffix(".json").write_text(json.dumps({"results": results, "ceilings": ceil, "host": host,
                                                            "bandwidth": bandwidth}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
