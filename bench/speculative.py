"""Speculative decoding against plain decoding of the same artifact and against the peers, in one run.

**ExecuTorch.** The shipped example ``examples/smollm2_speculative.yaml`` (the demo's recipe plus
``verify_tokens`` and a draft model the pipeline makes; run here through ``run_pipeline``, resumed
from its run directory when it exists) decodes every prompt plainly (``forward``, the path the
project ships), with ``--speculative ngram`` (prompt lookup) and with ``--speculative draft`` (the
program's own draft model, prompt lookup where it matches); ``--with-optimum`` adds the peer's 8da4w
``.pte`` (optimum-executorch, built in its own venv by ``bench/executorch.py``'s helpers; about 11
minutes the first time) decoding plainly.

**ONNX Runtime** (``--onnx``). ``examples/smollm2_onnx_int4.yaml`` exported with ``verify_tokens``
runs through onnxruntime-genai (``GenaiRunner``: what apps run), plainly and with prompt lookup,
against onnxruntime-genai's model builder int4 of the same model decoding plainly (the peer).

Prompt sets, built from text the project ships (:func:`prompt_sets`):

- **extraction**: a passage of CPython's bundled documentation (``pydoc_data.topics``) or the source
  of a standard-library function, and an instruction whose answer copies spans of it (quote,
  repeat a list, fill a form, edit one line of the function);
- **summary**: the same kind of passage, summarised;
- **chat**: open questions without a passage.

Per set and decoder: decode tokens/s (generated tokens after the first over the time from the
first token, which ends the prefill, to the last), tokens per verification call, drafts accepted, the
ratio to plain decoding of the same artifact and to the peer (each paired within a round, round-robin
over the decoders, median over rounds), and whether every output equals plain greedy decoding.

``--temperature T`` (with ``--top-p``) samples instead (``export.decoding.sampling``), every decoder with the
same seed for a prompt (from its ids): speculative rows must then give plain sampling's tokens, and
the drafts, still greedy, are kept by the standard rejection rule, so fewer are kept than greedy keeps.

    flock /tmp/heavy.lock .venv/bin/python bench/speculative.py [--rounds 3] [--with-optimum] [--onnx] [--pte model.pte]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "1")  # MKL serial beside ExecuTorch's workers (export/executorch/blas_threads.py)
import torch  # noqa: E402

THREADS = 2
MAX_NEW = 96
VERIFY_TOKENS = 5  # drafts of up to 4 tokens: a call pays for its rows, repeats included (docs/executorch.md)
#: --temperature / --top-p: how every decoder samples (an export.decoding.sampling.Sampling; None: greedy); each
#: prompt's seed comes from its ids
SAMPLING = None


def sampling_for(ids: list[int]):
    """The prompt's ``Sampling`` (one seed per prompt, the same for every decoder and round), or None."""
    import dataclasses
    import zlib

    if SAMPLING is None:
        return None
    return dataclasses.replace(SAMPLING, seed=zlib.crc32(json.dumps(list(ids)).encode()))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _passages(n: int, start: int = 40, chars: int = 700) -> list[str]:
    """``n`` passages of CPython's bundled documentation (the project's reference text)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)[start:]
    out = []
    for k in keys:
        text = " ".join(topics[k].split())
        if len(text) >= chars:
            out.append(text[:chars].rsplit(". ", 1)[0] + ".")
        if len(out) == n:
            break
    return out


def _functions(n: int) -> list[str]:
    """The source of ``n`` short standard-library functions."""
    import json as js
    import shlex
    import textwrap as tw

    import fnmatch
    import posixpath

    out = []
    for fn in (shlex.quote, tw.dedent, fnmatch.translate, posixpath.commonprefix, tw.indent, js.dumps):
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):  # a build without that module's source
            continue
        if len(src) < 2500:
            out.append(src)
        if len(out) == n:
            break
    return out


def prompt_sets() -> dict[str, list[str]]:
    p = _passages(6)
    f = _functions(3)
    extraction = [
        f"Passage:\n{p[0]}\n\nQuote the passage's first two sentences exactly.",
        f"Passage:\n{p[1]}\n\nRepeat the passage word for word.",
        f"Passage:\n{p[2]}\n\nList every Python keyword or name that appears in the passage, one per line.",
        f"Passage:\n{p[3]}\n\nFill in this form from the passage.\nTopic:\nFirst sentence:\nLast sentence:",
        f"```python\n{f[0]}```\n\nRewrite this function with its first line changed to use two-space indentation. "
        "Output the whole function.",
        f"```python\n{f[1]}```\n\nCopy this function exactly, adding the comment `# checked` after its first line.",
    ]
    summary = [f"Passage:\n{x}\n\nSummarize the passage in two sentences." for x in p[4:6]] + \
              [f"```python\n{f[2]}```\n\nExplain briefly what this function does."]
    chat = ["What is the capital of France, and what is it known for?",
            "Give three tips for writing clear emails.",
            "Why is the sky blue? Answer in a short paragraph."]
    return {"extraction": extraction, "summary": summary, "chat": chat}


def _decode(generate, ids: list[int]) -> tuple[list[int], float, dict]:
    """Run ``generate(ids, on_token)``; returns (tokens, seconds from the first token, which ends the
    prefill, to the last, stats)."""
    stamps: list[float] = []
    out, stats = generate(ids, lambda _t: stamps.append(time.perf_counter()))
    return out, max(stamps[-1] - stamps[0], 1e-9), stats


def decode_plain(runner, ids: list[int], eos: list[int]) -> tuple[list[int], float, dict]:
    """Decode one token a call (greedy, or as ``SAMPLING`` says); returns (tokens, decode seconds after the
    prefill, stats)."""
    from export.decoding.runtime import generate_ids

    def generate(ids, on_token):
        out = generate_ids(runner, ids, MAX_NEW, sampling=sampling_for(ids), eos_token_ids=eos, on_token=on_token)
        return out, {"calls": max(len(out) - 1, 0)}

    return _decode(generate, ids)


def decode_speculative(runner, ids: list[int], eos: list[int], drafter=None) -> tuple[list[int], float, dict]:
    from export.decoding.speculative import speculative_generate

    def generate(ids, on_token):
        out, stats = speculative_generate(runner, ids, MAX_NEW, drafter=drafter, eos_token_ids=eos, on_token=on_token,
                                          sampling=sampling_for(ids))
        return out, stats.as_dict()

    return _decode(generate, ids)


EXAMPLES = HERE.parent / "examples"
#: the shipped example each runtime's rows measure, and the overrides the bench runs it with: its
#: export, its draft and the checks that gate them (the accuracy rows are the pipeline's own business)
ET_EXAMPLE = EXAMPLES / "smollm2_speculative.yaml"
ORT_EXAMPLE = EXAMPLES / "smollm2_onnx_int4.yaml"
QUICK_CHECKS = ["checks.latency.enabled=false", "checks.memory=false", "checks.accuracy=false",
                "checks.generate_tokens=16", "gates.on_fail=warn"]


def example_artifact(yaml: Path, target: str, overrides: list[str], out: Path) -> Path:
    """The example's export, made by the pipeline (resumed from ``out`` when an earlier run left it)."""
    from optimize import load_config, run_pipeline

    cfg = load_config(yaml, [*overrides, *QUICK_CHECKS], target=target)
    log(f"{yaml.name}: optimize pipeline into {out} (resumes what an earlier run finished)")
    report = run_pipeline(cfg, output_dir=out)
    row = report.row(f"export:{target}")
    if row is None or row.artifact is None:
        raise SystemExit(f"error: {yaml.name} made no {target} artifact: see {out}/report.md")
    return Path(row.artifact)


def decoders_executorch(args, lm) -> tuple[dict, str]:
    """plain / ngram / draft (when the program has one) / peer: runner and decode function each."""
    from export.executorch.runner import ExecuTorchRunner, set_threads
    from export.decoding.runtime import RunnerError
    from export.decoding.speculative import HybridDrafter, ModelDrafter

    pte = args.pte or example_artifact(ET_EXAMPLE, "executorch", [], args.cache_dir / "smollm2-speculative")
    set_threads(THREADS)
    plain = ExecuTorchRunner(pte, threads=THREADS)
    verifier = plain.speculative_runner()
    decoders = {"plain": (plain, decode_plain), "ngram": (verifier, decode_speculative)}
    try:
        drafter = HybridDrafter(ModelDrafter(plain.draft_runner(), vocab_ids=plain.draft_vocab))
        decoders["draft"] = (verifier, lambda r, ids, eos: decode_speculative(r, ids, eos, drafter))
    except RunnerError as exc:
        log(f"no draft rows: {exc}")
    if args.with_optimum:
        from bench.executorch import export_peer
        from targets.sources import bundled_gguf_path, convert_gguf

        peer_pte, _ = export_peer(convert_gguf(bundled_gguf_path("smollm2-135m")), args.cache_dir)
        decoders["peer"] = (ExecuTorchRunner(peer_pte, threads=THREADS), decode_plain)
    return decoders, (f"ExecuTorch: {pte} ({pte.stat().st_size / 2**20:.1f} MiB; verify up to {verifier.verify_tokens} "
                      "tokens a call), peer optimum-executorch 8da4w")


def decoders_onnx(args, lm) -> tuple[dict, str]:
    """Our 4-bit directory through onnxruntime-genai, plainly and with prompt lookup, and the model
    builder's int4 decoding plainly (the peer)."""
    from bench.onnxruntime import build_peer
    from export.onnxruntime.genai_runner import GenaiRunner

    folder = args.onnx_dir or example_artifact(ORT_EXAMPLE, "onnxruntime", [f"export.onnxruntime.verify_tokens={VERIFY_TOKENS}"],
                                               args.cache_dir / "smollm2-onnx-int4-verify").parent
    peer_dir = args.cache_dir / "builder-int4"
    if not (peer_dir / "genai_config.json").is_file():
        log("peer: onnxruntime-genai's model builder, int4")
        build_peer("int4", Path(lm.local_dir), peer_dir)  # as bench/onnxruntime.py builds it
    plain = GenaiRunner(folder, intra_op_threads=THREADS)
    decoders = {"plain": (plain, decode_plain), "ngram": (plain.speculative_runner(), decode_speculative),
                "peer": (GenaiRunner(peer_dir, intra_op_threads=THREADS), decode_plain)}
    return decoders, f"onnxruntime-genai: {folder} (ours, 4-bit, verify_tokens {VERIFY_TOKENS}), peer: model builder int4"


def run_rounds(decoders: dict, encoded: dict, eos: list[int], rounds: int, label: str):
    """Every prompt of every set through every decoder, round-robin (the order alternates by round and
    prompt); returns per set and decoder the rates per round, the first round's stats and outputs."""
    samples = {s: {d: [] for d in decoders} for s in encoded}
    stats = {s: {d: [] for d in decoders} for s in encoded}
    outputs: dict[tuple[str, int, str], list[int]] = {}
    for r in range(rounds):
        log(f"{label}: round {r + 1}/{rounds}")
        for s, prompts in encoded.items():
            tot = {d: [0, 0.0] for d in decoders}
            for i, ids in enumerate(prompts):
                order = list(decoders) if (r + i) % 2 == 0 else list(reversed(decoders))
                for d in order:
                    runner, fn = decoders[d]
                    out, secs, st = fn(runner, ids, eos)
                    tot[d][0] += max(len(out) - 1, 0)
                    tot[d][1] += secs
                    if r == 0:
                        outputs[(s, i, d)] = out
                        stats[s][d].append(st)
            for d in decoders:
                samples[s][d].append(tot[d][0] / tot[d][1])
    return samples, stats, outputs


def table(label: str, decoders: dict, sets: dict, samples, stats, outputs) -> tuple[list[str], dict]:
    lines = [f"**{label}**", "",
             "| set | prompts | decoder | decode tok/s | x plain | x peer | tokens/call | drafts accepted | same tokens as plain |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    result = {}
    for s in sets:
        for d in decoders:
            rate = statistics.median(samples[s][d])
            ratio = statistics.median(a / b for a, b in zip(samples[s][d], samples[s]["plain"]))
            vs_peer = (statistics.median(a / b for a, b in zip(samples[s][d], samples[s]["peer"]))
                       if "peer" in decoders else None)
            same = all(outputs[(s, i, d)] == outputs[(s, i, "plain")] for i in range(len(sets[s])))
            st = stats[s][d]
            calls = sum(x.get("calls", 0) for x in st)
            toks = sum(len(outputs[(s, i, d)]) for i in range(len(sets[s])))
            drafted = sum(x.get("drafted", 0) for x in st)
            accepted = sum(x.get("accepted", 0) for x in st)
            tpc = (toks - len(sets[s])) / calls if calls else None  # after the prefill's token
            acc = f"{accepted}/{drafted}" if drafted else "-"
            tpc_s = f"{tpc:.2f}" if tpc else "-"
            same_s = "n/a (another model)" if d == "peer" else ("yes" if same else "NO")
            peer_s = f"{vs_peer:.2f}" if vs_peer is not None else "-"
            lines.append(f"| {s} | {len(sets[s])} | {d} | {rate:.1f} | {ratio:.2f} | {peer_s} | {tpc_s} | {acc} | {same_s} |")
            result[f"{s}/{d}"] = {"decode_tok_s": rate, "x_plain": ratio, "x_peer": vs_peer, "tokens_per_call": tpc,
                                  "drafted": drafted, "accepted": accepted, "same_as_plain": same,
                                  "samples": samples[s][d]}
    return lines, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="round-robin passes over every prompt and decoder")
    ap.add_argument("--with-optimum", action="store_true", help="add optimum-executorch's 8da4w .pte, decoding plainly")
    ap.add_argument("--onnx", action="store_true", help="also the ONNX rows (ours 4-bit through onnxruntime-genai "
                    "against the model builder's int4)")
    ap.add_argument("--no-executorch", action="store_true", help="skip the ExecuTorch rows")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/bench_executorch"),
                    help="exports (shared with bench/executorch.py), the examples' runs and the peer's venv")
    ap.add_argument("--output", type=Path, default=Path("/tmp/bench_speculative.txt"), help="table (and .json beside it)")
    ap.add_argument("--pte", type=Path, help="time this program (it must carry verify; a draft method adds the draft "
                    "rows) instead of the example's")
    ap.add_argument("--onnx-dir", type=Path, help="time this ONNX export folder (exported with verify_tokens)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling")
    args = ap.parse_args(argv)
    from optimize.generate import sampling_from

    global SAMPLING
    SAMPLING = sampling_from(args.temperature, top_p=args.top_p)  # refused here, before anything loads
    torch.set_num_threads(THREADS)
    args.cache_dir.mkdir(parents=True, exist_ok=True)

    from targets.sources import BundledSource, load_model

    t_all = time.perf_counter()
    lm = load_model(BundledSource(name="smollm2-135m"))
    tok = lm.tokenizer
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    sets = prompt_sets()

    def encode(prompt: str) -> list[int]:  # as optimize run --chat does
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    encoded = {name: [encode(p) for p in prompts] for name, prompts in sets.items()}
    runtimes = ([] if args.no_executorch else [decoders_executorch]) + ([decoders_onnx] if args.onnx else [])
    lines = [f"bench/speculative.py: SmolLM2-135M-Instruct, {THREADS} threads, {MAX_NEW} new tokens at most per prompt "
             f"({'greedy' if SAMPLING is None else f'sampled: temperature {SAMPLING.temperature}, top-p {SAMPLING.top_p}, a seed per prompt'}, EOS stops), "
             "chat template; decode tok/s = generated tokens after the first / time from the first "
             f"token (the end of the prefill) to the last; {args.rounds} round-robin rounds, median; x plain, x peer = "
             "the ratio within each round, median.", ""]
    result, bad = {}, []
    for make in runtimes:
        decoders, label = make(args, lm)
        samples, stats, outputs = run_rounds(decoders, encoded, eos, args.rounds, label.split(":")[0])
        rows, res = table(label, decoders, sets, samples, stats, outputs)
        lines += rows + [""]
        bad += [f"{label.split(':')[0]}/{k}" for k, v in res.items() if not v["same_as_plain"] and not k.endswith("/peer")]
        # what decides whether drafts pay on this host: the verification calls' price, as the policy measured it
        policy = getattr(decoders["ngram"][0], "draft_policy", None)
        if policy is not None and policy.relative:
            lines += ["Verification calls, in one-token steps (the draft policy's medians at the end): " + ", ".join(
                f"{n} tokens {c:.2f}" for n, c in sorted(policy.relative.items())) + ".", ""]
            res["verify_call_cost"] = {n: round(c, 3) for n, c in sorted(policy.relative.items())}
        result[label.split(":")[0]] = res
    lines += [f"Wall time {time.perf_counter() - t_all:.0f} s; load avg {os.getloadavg()[0]:.1f} at the end."]
    text = "\n".join(lines)
    print(text)
    args.output.write_text(text + "\n")
    args.output.with_suffix(".json").write_text(json.dumps(result, indent=1))
    if bad:
        print(f"error: outputs differ from plain {'greedy decoding' if SAMPLING is None else 'sampling'}: {bad}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
