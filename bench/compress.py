"""Benchmark pruning + healing and QAT on SmolLM2-135M: one table, every row with the same budget.

Pruning rows (each: prune on calibration text -> heal by distillation from the unpruned model
for ``--budget-minutes`` -> 8da8w PTQ -> ExecuTorch .pte):
  base     the unpruned model (no healing), the speed and size reference
  depth    30 -> 24 blocks (ShortGPT block influence)
  mlp      MLP width -25% (1536 -> 1152 channels, Minitron activation importance)
  heads    query heads per GQA group -1/3 (9 -> 6 heads, 3 KV heads kept)
  sparse24 2:4 on the MLP Linears (Wanda scores); zeros kept during healing
Per row: parameters, .pte size, .pte decode tok/s (prompt 128, 64 greedy tokens, median of 3),
perplexity right after pruning, after healing and after healing + 8da8w (eager, and the .pte).

QAT rows: fp32; 8da4w PTQ (round-to-nearest, group 32, lm_head 8da8w); 8da4w QAT (same layout,
distilled from the fp32 model for the same budget), each eager and through the .pte; then the
fraction of the PTQ gap QAT recovers and the curve of that fraction against training tokens
(curve points are measured on the fake-quantized model during training; the last point is the
converted model).

Perplexity is the project's reference: the first 4097 pydoc tokens in 512-token windows.
Calibration text and training text come after the evaluation span (targets.sources.corpus.split_corpus),
so nothing is tuned on what is measured. Finished rows are cached as JSON under
``--work-dir`` (keyed by the row's settings), so an interrupted run resumes where it stopped:

    flock /tmp/heavy.lock .venv/bin/python bench/compress.py --budget-minutes 10 --out /tmp/compress.md
    .venv/bin/python bench/compress.py --rows depth,qat --budget-minutes 1    # a short check
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

# Run as a script, this file's folder would come first on sys.path and shadow packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("OMP_NUM_THREADS", "2")
# before torch loads: MKL serial on ExecuTorch's workers (export/executorch/blas_threads.py); main() sets torch's threads
os.environ.setdefault("MKL_NUM_THREADS", "1")
import torch  # noqa: E402

THREADS, PROMPT, DECODE, MAX_SEQ = 2, 128, 64, 512
PRUNE_ROWS = {
    "base": None,
    "depth": {"method": "depth", "num_hidden_layers": 24},
    "mlp": {"method": "width", "mlp_ratio": 0.25},
    "heads": {"method": "width", "num_attention_heads": 6},
    "sparse24": {"method": "semi_structured", "modules": ["*.mlp.*"], "score": "wanda"},
}
QAT_ROWS = ("qat",)
#: the QAT row's three .pte results -> their directory names
QAT_PTES = {"fp32_pte": "qat-fp32", "ptq_pte": "qat-ptq8da4w", "qat_pte": "qat-qat8da4w"}
# Every Linear at 8da8w, lm_head included: decode reads lm_head for every token, and an fp32 head
# (113 MB of a 238 MB .pte on SmolLM2) would hide what pruning the blocks saves.
PTQ8 = dict(scheme="8da8w", keep_high_precision=[])
PTQ4 = dict(scheme="8da4w", group_size=32, keep_high_precision=[], int8_modules=["lm_head"])


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args):
        from targets.sources.corpus import load_text, split_corpus, tokenize
        from targets.sources import BundledSource, load_model

        self.args = args
        loaded = load_model(BundledSource(name="smollm2-135m"))
        self.model, self.tok = loaded.model.eval(), loaded.tokenizer
        ids = tokenize(load_text("pydoc"), self.tok)
        self.prompt = ids[5000:5000 + PROMPT]
        s = split_corpus(ids, eval_tokens=args.eval_tokens, calib_tokens=args.calib_tokens)
        self.eval_ids, self.train_ids = s.eval_ids, s.train_ids
        self.calib = [s.calib_ids[i:i + MAX_SEQ] for i in range(0, s.calib_ids.numel() - MAX_SEQ + 1, MAX_SEQ)]
        self.work = Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)

    # ---- measurements
    def ppl(self, model) -> float:
        from export.decoding.runtime import EagerRunner
        from export.verify import perplexity

        return round(perplexity(EagerRunner(model), self.eval_ids, MAX_SEQ)["perplexity"], 3)

    def export(self, model, name: str, row: str) -> dict:
        """Export (cached by name) and measure size, decode speed and perplexity in the runtime."""
        from export.executorch.exporter import ExecuTorchExporter
        from export.executorch.runner import set_threads
        from export.verify import latency, perplexity

        none = {"pte_mb": None, "decode_tok_s": None, "prefill_ms": None, "pte_ppl": None}
        if not self.exports(row):
            return none
        out = self.work / "pte" / name
        if not (out / "manifest.json").exists():
            t0 = time.perf_counter()
            try:
                ExecuTorchExporter().export(model, self.tok, out, {"max_seq_len": MAX_SEQ}, log=lambda m: None)
            except Exception as exc:  # keep the row's eager figures; the table lists the failure
                traceback.print_exc()
                return {**none, "pte_error": f"{type(exc).__name__}: {exc}"}
            say(f"  exported {name} in {time.perf_counter() - t0:.0f}s")
        set_threads(THREADS)
        runner = ExecuTorchExporter().load(out / "model.pte", threads=THREADS)
        lat = latency(runner, self.prompt, DECODE, runs=3, warmup=1)
        ppl = perplexity(runner, self.eval_ids, MAX_SEQ)["perplexity"]
        size = runner.size_bytes()
        runner.close()
        return {"pte_mb": round(size / 2**20, 2), "decode_tok_s": round(lat["decode_tok_s"], 1),
                "prefill_ms": round(lat["prefill_ms"], 1), "pte_ppl": round(ppl, 3)}

    def ctx(self, work: Path, baseline=None):
        from optimize.stage_api import StageContext

        return StageContext(tokenizer=self.tok, calibration=self.calib, train_ids=self.train_ids, target=None,
                            work_dir=work, seed=0, baseline_model=baseline, log=lambda m: None)

    # ---- budget: optimizer steps that fit the wall-clock budget on this model
    def steps_for_budget(self, model, teacher, cfg_kw: dict, cls) -> tuple[int, float]:
        from optimize.stage_api import get_stage

        probe = copy.deepcopy(model)
        ctx = self.ctx(self.work / "probe", teacher)
        get_stage(cls.model_fields["kind"].default).fn(probe, cls(**{**cfg_kw, "steps": 3}), ctx)
        per_step = ctx.details["wall_s"] / 3  # the training loop alone (not QAT's prepare/convert)
        del probe
        return max(1, int(self.args.budget_minutes * 60 / per_step)), per_step

    def heal_cfg(self) -> dict:
        a = self.args
        return dict(seq_len=a.seq_len, batch={"micro_batch_size": a.batch}, optimizer={"lr": a.heal_lr},
                    schedule={"warmup_steps": 5, "decay": "cosine", "min_lr_ratio": 0.1})

    # ---- rows
    def prune_row(self, name: str) -> dict:
        from optimize.stage_api import get_stage
        from optimize.stages.distill import DistillConfig
        from optimize.stages.prune import PruneConfig
        from optimize.stages.ptq_int8 import Ptq8Config

        spec = PRUNE_ROWS[name]
        model = copy.deepcopy(self.model)
        row = {"row": name}
        if spec is not None:
            ctx = self.ctx(self.work / name)
            model = get_stage("prune").fn(model, PruneConfig(**spec), ctx)
            row["removed"] = {k: ctx.details.get(k) for k in ("removed_blocks", "num_attention_heads",
                                                              "intermediate_size", "pattern") if k in ctx.details}
        row["params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        row["ppl_pruned"] = self.ppl(model)
        say(f"{name}: {row['params'] / 1e6:.1f}M params, ppl after pruning {row['ppl_pruned']}")
        if spec is not None:
            steps, per_step = self.steps_for_budget(model, self.model, self.heal_cfg(), DistillConfig)
            ctx = self.ctx(self.work / name, self.model)
            t0 = time.perf_counter()
            get_stage("distill").fn(model, DistillConfig(steps=steps, **self.heal_cfg()), ctx)
            row.update(heal_steps=steps, heal_tokens=ctx.details["tokens_seen"],
                       heal_minutes=round((time.perf_counter() - t0) / 60, 2), heal_loss=[
                           round(ctx.details["loss_first5_mean"], 4), round(ctx.details["loss_last5_mean"], 4)])
            row["ppl_healed"] = self.ppl(model)
            say(f"{name}: healed {steps} steps ({row['heal_tokens']} tokens), ppl {row['ppl_healed']}")
        get_stage("ptq_int8").fn(model, Ptq8Config(**PTQ8), self.ctx(self.work / name))
        row["ppl_8da8w"] = self.ppl(model)
        row.update(self.export(model, self.pte_name(name), name))
        say(f"{name}: 8da8w ppl {row['ppl_8da8w']}, .pte {row['pte_mb']} MB {row['decode_tok_s']} tok/s")
        return row

    def qat_row(self) -> dict:
        from torchao.quantization import quantize_
        from torchao.quantization.qat import QATConfig

        from optimize.finetune import finetune
        from optimize.losses import DistillLoss
        from optimize.stage_api import get_stage
        from optimize.stages.ptq_int8 import Ptq8Config, linear_config
        from optimize.stages.qat import QatConfig

        row = {"row": "qat", "ppl_fp32": self.ppl(self.model)}
        row["fp32_pte"] = self.export(self.model, self.pte_name("qat", "fp32_pte"), "qat")
        ptq = get_stage("ptq_int8").fn(copy.deepcopy(self.model), Ptq8Config(**PTQ4), self.ctx(self.work / "qat"))
        row["ppl_ptq"] = self.ppl(ptq)
        row["ptq_pte"] = self.export(ptq, self.pte_name("qat", "ptq_pte"), "qat")
        del ptq
        say(f"qat: fp32 {row['ppl_fp32']}, 8da4w PTQ {row['ppl_ptq']} (.pte {row['ptq_pte']['pte_ppl']})")

        qcfg = dict(self.heal_cfg(), optimizer={"lr": self.args.qat_lr}, **PTQ4)
        steps, _ = self.steps_for_budget(self.model, self.model, qcfg, QatConfig)
        cfg = QatConfig(steps=steps, **qcfg)
        model = copy.deepcopy(self.model)
        p = cfg.ptq_config().layer_plan(model)
        eight = set(p["int8"])
        groups = [(linear_config(cfg.ptq_config()), set(p["selected"]) - eight),
                  (linear_config(cfg.ptq_config().model_copy(update={"scheme": "8da8w", "group_size": None})), eight)]
        for base, names in groups:
            quantize_(model, QATConfig(base, step="prepare"), filter_fn=lambda m, f, n=names: f in n)
        points = sorted({0, steps // 8, steps // 4, steps // 2})
        curve, state = [], {"calls": 0, "eval_s": 0.0}
        tokens_per_step = self.args.seq_len * self.args.batch
        loss = DistillLoss(self.model, chunk_size=1024)

        def with_curve(m, batch):
            if state["calls"] in points:
                t0 = time.perf_counter()
                with torch.no_grad():
                    curve.append((state["calls"] * tokens_per_step, self.ppl(m)))
                state["eval_s"] += time.perf_counter() - t0
                say(f"qat: step {state['calls']}: fake-quant ppl {curve[-1][1]}")
            state["calls"] += 1
            return loss(m, batch)

        t0 = time.perf_counter()
        facts = finetune(model, cfg, self.train_ids, loss_fn=with_curve, who="qat", log=lambda m: None)
        train_min = (time.perf_counter() - t0 - state["eval_s"]) / 60
        for base, names in groups:
            quantize_(model, QATConfig(base, step="convert"), filter_fn=lambda m, f, n=names: f in n)
        row["ppl_qat"] = self.ppl(model)
        curve.append((facts["tokens_seen"], row["ppl_qat"]))
        row["qat_pte"] = self.export(model, self.pte_name("qat", "qat_pte"), "qat")
        gap = row["ppl_ptq"] - row["ppl_fp32"]
        row.update(qat_steps=steps, qat_tokens=facts["tokens_seen"], qat_minutes=round(train_min, 2),
                   recovered=round((row["ppl_ptq"] - row["ppl_qat"]) / gap, 3) if gap > 0 else None,
                   curve=[(t, p, round((row["ppl_ptq"] - p) / gap, 3) if gap > 0 else None) for t, p in curve])
        row["recovered_pte"] = None
        if None not in (row["fp32_pte"]["pte_ppl"], row["ptq_pte"]["pte_ppl"], row["qat_pte"]["pte_ppl"]):
            pte_gap = row["ptq_pte"]["pte_ppl"] - row["fp32_pte"]["pte_ppl"]
            row["recovered_pte"] = round((row["ptq_pte"]["pte_ppl"] - row["qat_pte"]["pte_ppl"]) / pte_gap, 3) \
                if pte_gap > 0 else None
        say(f"qat: {steps} steps, ppl {row['ppl_qat']} (.pte {row['qat_pte']['pte_ppl']}), "
            f"recovered {row['recovered']} of the PTQ gap")
        return row

    def exports(self, row: str) -> bool:
        """Whether this row's models go through the .pte (--no-export / --export-rows)."""
        a = self.args
        return not a.no_export and (a.export_rows is None or row in a.export_rows.split(","))

    # ---- speed: every .pte again, in one quiet pass at the end
    def retime(self, rows: list[dict], rounds: int = 8) -> None:
        """Re-measure every row's .pte decode and prefill, interleaved round by round, and keep
        the median: each row was first timed right after its own export, minutes (and machine
        load) apart from the base row it is compared with."""
        slots = []
        for r in rows:
            fields = [(k, r.get(k)) for k in QAT_PTES] if r["row"] == "qat" else [(None, r)]
            for field, res in fields:
                if not isinstance(res, dict) or res.get("decode_tok_s") is None:
                    continue
                path = self.work / "pte" / self.pte_name(r["row"], field) / "model.pte"
                if path.is_file():
                    slots.append((res, path))
        if not slots:
            return
        from bench.retiming import round_robin, summarize

        say(f"re-timing {len(slots)} .pte files, {rounds} interleaved rounds")
        samples = round_robin({str(i): path for i, (_, path) in enumerate(slots)}, self.prompt, DECODE, rounds,
                              THREADS, log=say)
        for key, row in summarize(samples).items():
            res = slots[int(key)][0]
            res["decode_tok_s"] = round(row["decode_tok_s"], 1)
            res["prefill_ms"] = round(row["prefill128_ms"], 1)
            res["decode_best"] = round(row["decode_best"], 1)  # the least disturbed sample
            res["decode_samples"] = row["decode_samples"]

    def pte_name(self, row: str, field: str | None = None) -> str:
        """Directory under ``<work>/pte`` of a row's .pte; ``field`` picks one of the QAT row's three.
        Trained models carry the row's cache key; base, fp32 and PTQ do not depend on the budget."""
        if field is not None:
            return f"{QAT_PTES[field]}-{self._key(row)}" if field == "qat_pte" else QAT_PTES[field]
        return f"{row}-8da8w" + (f"-{self._key(row)}" if PRUNE_ROWS.get(row) is not None else "")

    # ---- caching
    def _key(self, name: str) -> str:
        a = self.args
        spec = {"row": name, "spec": PRUNE_ROWS.get(name), "ptq": PTQ8, "budget": a.budget_minutes, "eval": a.eval_tokens,
                "calib": a.calib_tokens, "seq": a.seq_len, "batch": a.batch, "lr": a.heal_lr, "qat_lr": a.qat_lr,
                "export": self.exports(name)}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]

    def run(self, name: str) -> dict:
        path = self.work / "rows" / f"{name}-{self._key(name)}.json"
        if path.exists():
            say(f"{name}: cached ({path})")
            return json.loads(path.read_text())
        say(f"{name}: running")
        t0 = time.perf_counter()
        try:
            row = self.qat_row() if name == "qat" else self.prune_row(name)
        except Exception as exc:  # unattended: record the failure, go on with the next row
            traceback.print_exc()
            return {"row": name, "error": f"{type(exc).__name__}: {exc}"}
        row["wall_minutes"] = round((time.perf_counter() - t0) / 60, 1)
        if _pte_errors([row]):  # not cached: a re-run retries the export
            return row
        path.parent.mkdir(parents=True, exist_ok=True)
        from targets.atomic import atomic_write_json

        atomic_write_json(path, row)
        return row


def _c(value) -> str:
    """A table cell: '-' where nothing was measured (row not exported, or its export failed)."""
    return "-" if value is None else str(value)


def _pte_errors(rows: list[dict]) -> list[tuple[str, str]]:
    found = []
    for r in rows:
        if "pte_error" in r:
            found.append((r["row"], r["pte_error"]))
        for key in ("fp32_pte", "ptq_pte", "qat_pte"):
            if isinstance(r.get(key), dict) and "pte_error" in r[key]:
                found.append((f"{r['row']}:{key}", r[key]["pte_error"]))
    return found


def table(rows: list[dict], args) -> str:
    out = [f"SmolLM2-135M, pydoc reference perplexity ({args.eval_tokens} targets, 512-token windows); healing/QAT "
           f"budget {args.budget_minutes} min per row on {THREADS} threads (seq {args.seq_len} x batch {args.batch}); "
           f".pte: ExecuTorch/XNNPACK 8da8w (every Linear, lm_head included), {THREADS} threads, prompt {PROMPT}, decode {DECODE} "
           f"({'median of 8 interleaved rounds over every .pte after all rows; best = fastest round' if not args.no_retime else 'median of 3 right after each export'})", ""]
    prune = [r for r in rows if r["row"] in PRUNE_ROWS]
    base = next((r for r in prune if r["row"] == "base" and "error" not in r), None)
    if prune:
        out += ["| row | params | .pte MB | decode tok/s | x base | best tok/s | best x base | ppl pruned | ppl healed "
                "| recovered | ppl +8da8w | .pte ppl | heal tokens |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in prune:
            if "error" in r:
                out.append(f"| {r['row']} | error: {r['error'][:80]} |||||||||| ")
                continue
            speed = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}" if base and r["decode_tok_s"] and \
                base["decode_tok_s"] else "-"
            best = f"{r['decode_best'] / base['decode_best']:.2f}" if base and r.get("decode_best") and \
                base.get("decode_best") else "-"
            rec = "-"
            if base and "ppl_healed" in r and r["ppl_pruned"] > base["ppl_pruned"]:
                rec = f"{(r['ppl_pruned'] - r['ppl_healed']) / (r['ppl_pruned'] - base['ppl_pruned']):.0%}"
            out.append(f"| {r['row']} | {r['params'] / 1e6:.1f}M | {_c(r['pte_mb'])} | {_c(r['decode_tok_s'])} | "
                       f"{speed} | {_c(r.get('decode_best'))} | {best} | {r['ppl_pruned']} | {r.get('ppl_healed', '-')} | {rec} | {r['ppl_8da8w']} | "
                       f"{_c(r['pte_ppl'])} | {r.get('heal_tokens', '-')} |")
        out += ["", "recovered = share of the perplexity lost to pruning that healing won back (vs base fp32)."]
    q = next((r for r in rows if r["row"] == "qat"), None)
    if q and "error" not in q:
        out += ["", "| QAT row | eager ppl | .pte ppl | .pte MB | decode tok/s |", "|---|---:|---:|---:|---:|"]
        for label, eager, pte in (("fp32", q["ppl_fp32"], q["fp32_pte"]), ("8da4w PTQ (RTN, lm_head 8da8w)",
                                  q["ppl_ptq"], q["ptq_pte"]), ("8da4w QAT", q["ppl_qat"], q["qat_pte"])):
            out.append(f"| {label} | {eager} | {_c(pte['pte_ppl'])} | {_c(pte['pte_mb'])} | {_c(pte['decode_tok_s'])} |")
        diff = q["qat_pte"]["pte_ppl"] - q["ppl_qat"] if q["qat_pte"]["pte_ppl"] is not None else None
        out += ["", f"QAT: {q['qat_steps']} steps, {q['qat_tokens']} tokens, {q['qat_minutes']} min; recovers "
                f"{q['recovered']} of the PTQ gap eager, {q['recovered_pte']} through the .pte "
                f"(.pte - eager QAT ppl: {'-' if diff is None else f'{diff:+.3f}'})",
                "curve (training tokens: ppl, fraction of the gap recovered): "
                + "; ".join(f"{t}: {p} ({f})" for t, p, f in q["curve"])]
    elif q:
        out += ["", f"qat: error: {q['error']}"]
    failed = _pte_errors(rows)
    if failed:
        out += ["", ".pte export failures (eager figures above still hold):"]
        out += [f"- {where}: {err[:300]}" for where, err in failed]
    out.append("Timings come from a shared machine: compare ratios within this run only.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    known = list(PRUNE_ROWS) + list(QAT_ROWS)
    ap.add_argument("--rows", default=",".join(known), help=f"comma-separated subset of {', '.join(known)}")
    ap.add_argument("--budget-minutes", type=float, default=10.0, help="healing / QAT wall-clock budget per row")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_compress"), help="cache of rows and .pte files")
    ap.add_argument("--eval-tokens", type=int, default=4096, help="perplexity targets (4096 = the reference)")
    ap.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens for the importance scores")
    ap.add_argument("--seq-len", type=int, default=256, help="training window")
    ap.add_argument("--batch", type=int, default=4, help="windows per optimizer step")
    ap.add_argument("--heal-lr", type=float, default=1e-4, help="healing (distillation) peak learning rate")
    ap.add_argument("--qat-lr", type=float, default=2e-5, help="QAT peak learning rate (same schedule as healing)")
    ap.add_argument("--no-export", action="store_true", help="eager figures only (skips the .pte columns)")
    ap.add_argument("--export-rows", help="comma-separated rows whose models are exported and measured as .pte "
                    "(default: every row); the others report eager figures only")
    ap.add_argument("--no-retime", action="store_true", help="keep each row's speed as timed right after its "
                    "export (default: re-time every .pte in one interleaved pass at the end)")
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in known]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; choose from {known}")
    unknown = [r for r in (args.export_rows or "").split(",") if r.strip() and r.strip() not in known]
    if unknown:
        ap.error(f"unknown --export-rows {unknown}; choose from {known}")
    if any(r in PRUNE_ROWS for r in rows) and "base" not in rows:
        rows.insert(0, "base")  # the reference every pruned row is compared with
    warnings.filterwarnings("ignore")
    torch.set_num_threads(THREADS)
    bench = Bench(args)
    results = [bench.run(r) for r in rows]
    if not args.no_retime:
        bench.retime(results)
    text = table(results, args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all("error" not in r for r in results) and not _pte_errors(results) else 1


if __name__ == "__main__":
    sys.exit(main())
