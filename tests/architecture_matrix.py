"""The architecture support matrix: a tiny random model of each family through load, the
stages, resume and both exporters. Every cell is one of

- ``pass``: ran, and the result checked out (exact stages: logits unchanged within
  ``EXACT_RTOL``; ptq_int8: logits within ``PTQ_REL_ERR``; resume: identical logits; exports:
  parity with eager within ``EXPORT_RTOL`` and the same argmax everywhere);
- ``refused``: refused before any work, from the config alone (pre-flight: the model source,
  ``StageConfig.check_model``, ``Exporter.check_model``), with a message;
- ``refused late``: a clear error of ours (an exception class of this project, or a
  ValueError our code raised) while running: a refusal, but one the pre-flight should make;
- ``n/a``: the step does not apply (rmsnorm on a model without LayerNorm);
- ``—``: not reached (the model itself was refused);
- ``FAIL``: anything else: a crash (a library's exception), or a wrong result.

Run it to write the table the README shows (rerun whenever exporters or stages change):

    OMP_NUM_THREADS=1 .venv/bin/python tests/architecture_matrix.py [--archs llama,gemma] [--out FILE]

``tests/test_architectures.py`` runs the same cells and asserts that none is ``FAIL``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gpt2", "opt", "gpt_neox",
         "mixtral", "bloom", "bert"]
COLUMNS = ["load", "ptq_int8", "smoothquant", "awq", "rmsnorm", "resume", "executorch", "onnxruntime"]
STAGE_OPTIONS = {"ptq_int8": {"scheme": "8da8w"}, "smoothquant": {}, "awq": {}, "rmsnorm": {}}
EXPORT_OPTIONS = {"executorch": {"max_seq_len": 64}, "onnxruntime": {}}

#: exact stages: max |logit change| <= EXACT_RTOL * max(1, max |logit|) on held-out windows
EXACT_RTOL = 1e-4
#: ptq_int8 8da8w: ||logits - fp32|| / ||fp32|| on held-out windows (random tiny models: ~1e-2)
PTQ_REL_ERR = 0.1
#: exports in fp32: max |logit difference| <= EXPORT_RTOL * max(1, max |logit|), argmax identical
EXPORT_RTOL = 1e-3

PASS, REFUSED, LATE, NA, SKIPPED, FAIL = "pass", "refused", "refused late", "n/a", "—", "FAIL"


@dataclass
class Cell:
    status: str
    note: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != FAIL


def tiny_configs() -> dict[str, dict]:
    """The tiny configs of tests/conftest.py (one definition for tests and this script)."""
    spec = importlib.util.spec_from_file_location("_tiny_conftest", HERE / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TINY_CONFIGS


def matrix_config(config: dict) -> dict:
    """One decoder layer: the family's structure is all there, and ExecuTorch lowering (most of
    the matrix's time) takes about half as long as with two."""
    key = "n_layer" if "n_layer" in config else "num_hidden_layers"
    return {**config, key: 1}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def _expected(exc: BaseException) -> bool:
    from optimize.cli import _is_expected

    return _is_expected(exc)


@dataclass
class ArchRun:
    """One family's model and data, shared by its cells."""

    arch: str
    config: dict
    work: Path
    log: Callable[[str], None] = lambda msg: None
    cells: dict[str, Cell] = field(default_factory=dict)
    loaded: Any = None
    calib: list = field(default_factory=list)
    probe: list = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    # ---- helpers

    def logits(self, model, windows=None):
        import torch

        with torch.no_grad():
            return [model(input_ids=w[None]).logits[0].float() for w in (windows or self.probe)]

    def baseline(self):
        if "baseline" not in self.results:
            self.results["baseline"] = self.logits(self.loaded.model)
        return self.results["baseline"]

    def context(self, name: str):
        from optimize.stage_api import StageContext
        import torch

        work = self.work / name
        work.mkdir(parents=True, exist_ok=True)
        return StageContext(tokenizer=self.loaded.tokenizer, calibration=list(self.calib),
                            train_ids=torch.cat(self.calib), target=None, work_dir=work, seed=0,
                            baseline_model=self.loaded.model, log=lambda msg: None)

    # ---- cells

    def run(self, columns=COLUMNS) -> dict[str, Cell]:
        for col in columns:
            t0 = time.perf_counter()
            if col != "load" and (self.cells.get("load") is None or self.cells["load"].status != PASS):
                cell = Cell(SKIPPED, "model refused at load")
            else:
                try:
                    cell = getattr(self, f"cell_{col}")() if hasattr(self, f"cell_{col}") else self.cell_stage(col)
                except Exception as exc:  # the rule: only our own clear errors are refusals
                    cell = Cell(LATE, _first_line(exc)) if _expected(exc) else Cell(
                        FAIL, f"crash: {_first_line(exc)}\n{traceback.format_exc(limit=6)}")
            cell.seconds = time.perf_counter() - t0
            self.cells[col] = cell
            self.log(f"{self.arch:12s} {col:12s} {cell.status:12s} {cell.seconds:6.1f}s {cell.note[:160]}")
        return self.cells

    def cell_load(self) -> Cell:
        from targets.sources.corpus import load_text, tokenize
        from targets.sources import ModelSourceError, RandomSource, load_model, peek_config

        src = RandomSource(config=copy.deepcopy(self.config), seed=0)
        try:
            peek_config(src)
        except ModelSourceError as exc:
            return Cell(REFUSED, str(exc))
        self.loaded = load_model(src)
        ids = tokenize(load_text("pydoc")[:40000], self.loaded.tokenizer)
        w = 64
        self.calib = [ids[i * w: (i + 1) * w] for i in range(4)]
        self.probe = [ids[(4 + i) * w: (5 + i) * w] for i in range(2)]
        return Cell(PASS, type(self.loaded.model).__name__)

    def cell_stage(self, kind: str) -> Cell:
        import torch
        from optimize.stage_api import get_stage

        spec = get_stage(kind)
        cfg = spec.config_cls.model_validate({"kind": kind, **STAGE_OPTIONS[kind]})
        problems = cfg.check_model(copy.deepcopy(self.loaded.model.config), None)
        if problems:
            return Cell(REFUSED, problems[0])
        if kind == "rmsnorm" and not any(isinstance(m, torch.nn.LayerNorm) for m in self.loaded.model.modules()):
            return Cell(NA, "no LayerNorm (the model already uses RMSNorm)")
        model = spec.fn(copy.deepcopy(self.loaded.model), cfg, self.context(kind)).eval()
        self.results[kind] = (model, cfg)
        after, ref = self.logits(model), self.baseline()
        if not all(torch.isfinite(a).all() for a in after):
            return Cell(FAIL, "non-finite logits after the stage")
        if kind == "ptq_int8":
            err = max(float((a - r).norm() / r.norm()) for a, r in zip(after, ref))
            ok = err <= PTQ_REL_ERR
            return Cell(PASS if ok else FAIL, f"8da8w relative logit error {err:.3g} (limit {PTQ_REL_ERR})")
        diff = max(float((a - r).abs().max()) for a, r in zip(after, ref))
        scale = max(1.0, max(float(r.abs().max()) for r in ref))
        ok = diff <= EXACT_RTOL * scale
        return Cell(PASS if ok else FAIL, f"claimed exact: max logit change {diff:.2g} "
                    f"({'within' if ok else 'OVER'} {EXACT_RTOL:g} x {scale:.3g})")

    def cell_resume(self) -> Cell:
        """Checkpoint round trip of every stage result that passed (quantized and rewritten models)."""
        import torch
        from optimize import checkpoints as ckpt
        from optimize.stage_api import get_stage

        checked = []
        candidates = {k: v for k, v in self.results.items() if k in STAGE_OPTIONS and self.cells[k].status == PASS}
        if not candidates:
            candidates = {"fp32": (self.loaded.model, None)}
        for kind, (model, cfg) in candidates.items():
            restores = []
            if cfg is not None and get_stage(kind).restore is not None:
                restores = [lambda m, s=get_stage(kind), c=cfg: s.restore(m, c)]
            path = ckpt.save_stage(self.work / "ckpt" / kind, model, {"status": "pass"}, {"kind": kind})
            resumed, _ = ckpt.load_stage(path, restores)
            same = all(torch.equal(a, b) for a, b in zip(self.logits(model), self.logits(resumed)))
            if not same:
                return Cell(FAIL, f"after {kind}: resumed logits differ from the saved model's")
            checked.append(kind)
        return Cell(PASS, "identical logits after " + ", ".join(checked))

    def _export(self, name: str) -> Cell:
        from export.base import get_exporter
        from export.decoding.runtime import EagerRunner
        from export.verify import logits_parity

        exporter = get_exporter(name)
        options = exporter.options_model.model_validate(EXPORT_OPTIONS[name])
        problems = exporter.check_model(copy.deepcopy(self.loaded.model.config), options)
        if problems:
            return Cell(REFUSED, problems[0])
        model = self.loaded.model
        result = exporter.export(model, self.loaded.tokenizer, self.work / "export" / name, options,
                                 calibration=self.calib, log=lambda *a, **k: None)
        runner = exporter.load(result.artifact)
        try:
            res = logits_parity(EagerRunner(model), runner, [w[:48] for w in self.probe])
        finally:
            runner.close()
        scale = max(1.0, max(float(r.abs().max()) for r in self.baseline()))
        ok = res["max_abs_diff"] <= EXPORT_RTOL * scale and res["top1_agreement"] == 1.0
        return Cell(PASS if ok else FAIL, f"fp32 parity: max |diff| {res['max_abs_diff']:.2g}, "
                    f"top-1 {res['top1_agreement']:.3f}")

    def cell_executorch(self) -> Cell:
        return self._export("executorch")

    def cell_onnxruntime(self) -> Cell:
        return self._export("onnxruntime")


def run_arch(arch: str, work: Path, log=lambda msg: None, columns=COLUMNS) -> dict[str, Cell]:
    return ArchRun(arch, matrix_config(tiny_configs()[arch]), work, log).run(columns)


SYMBOL = {PASS: "✅", REFUSED: "⛔", LATE: "⚠️", NA: "n/a", SKIPPED: "—", FAIL: "❌"}


def markdown(results: dict[str, dict[str, Cell]]) -> str:
    """The support table with numbered notes for every refusal and failure."""
    notes: list[str] = []

    def mark(cell: Cell) -> str:
        sym = SYMBOL[cell.status]
        if cell.status in (REFUSED, LATE, FAIL):
            text = cell.note.splitlines()[0] if cell.note else cell.status
            if text not in notes:
                notes.append(text)
            return f"{sym}<sup>{notes.index(text) + 1}</sup>"
        return sym

    lines = [
        "| architecture | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for arch, cells in results.items():
        lines.append(f"| {arch} | " + " | ".join(mark(cells[c]) if c in cells else " " for c in COLUMNS) + " |")
    legend = (
        "✅ pass (exact stages: logits unchanged within "
        f"{EXACT_RTOL:g}×scale; ptq_int8 8da8w: relative logit error ≤ {PTQ_REL_ERR:g}; resume: identical logits; "
        f"exports: fp32 parity within {EXPORT_RTOL:g}×scale, same argmax) · ⛔ refused before any work (pre-flight) · "
        "⚠️ refused while running (a clear error, but late) · n/a does not apply · — not reached (model refused) · "
        "❌ crash or wrong result"
    )
    out = ["<!-- generated by tests/architecture_matrix.py; do not edit by hand -->", "", *lines, "", legend, ""]
    out += [f"{i + 1}. {n}" for i, n in enumerate(notes)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default=",".join(ARCHS), help="comma-separated families (default: all)")
    p.add_argument("--out", default=str(HERE / "architecture_matrix.md"), help="markdown table to write")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import logging

    import torch

    torch.set_num_threads(1)
    logging.disable(logging.INFO)  # onnxscript's and our INFO chatter; the table is the output
    results = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arch-matrix-") as tmp:
        for arch in args.archs.split(","):
            results[arch] = run_arch(arch, Path(tmp) / arch, log=lambda m: print(m, flush=True))
    table = markdown(results)
    Path(args.out).write_text(table)
    print(f"\n{table}\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 1 if any(c.status == FAIL for cells in results.values() for c in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
