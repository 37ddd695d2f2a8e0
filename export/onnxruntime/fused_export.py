"""The ``graph: fused`` export: the builder's graph, our weights, onnxruntime-genai packaging.

Writes into the exporter's staging directory: ``model.onnx`` + ``model.onnx.data`` (the fused
graph with the stages' integers installed, see :mod:`export.onnxruntime.fused`), the builder's
``genai_config.json`` (search ``max_length`` set to the export's ``max_seq_len``), the tokenizer
files and ``config.json``. Returns the fused part of the manifest.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from export.base import ExportError
from export.onnxruntime.fused import FusedPlan, install, op_counts, plan_model, write_hf_dir
from export.onnxruntime.genai_builder import BuilderError, build
from export.onnxruntime.options import session_config_entries
from export.decoding.runtime import greedy_generate

GENAI_CONFIG = "genai_config.json"


def plan_for(model: torch.nn.Module, opts: Any) -> FusedPlan:
    return plan_model(
        model, per_token_fp32=opts.quantize == "dynamic_per_token", quantize_lm_head=opts.quantize_lm_head,
        quantize_embedding=opts.quantize_embedding, exclude_modules=list(opts.exclude_modules),
        int8_kernel=opts.int8_kernel, accuracy_level=opts.accuracy_level,
    )


def build_fused(model: torch.nn.Module, tokenizer: Any, opts: Any, stage: Path, work: Path, max_seq: int | None,
                log: Callable[[str], None]) -> dict:
    """Build the fused artifact into ``stage``; ``work`` is scratch space (deleted after)."""
    import onnxruntime_genai

    t0 = time.perf_counter()
    plan = plan_for(model, opts)
    hf = work / "hf"
    write_hf_dir(model, tokenizer, hf)
    built = work / "built"
    extra = {"fuse_qkv": "true" if plan.fuse_qkv else "false"}
    log(f"onnxruntime: building the fused graph with onnxruntime-genai {onnxruntime_genai.__version__}'s model builder"
        + ("" if plan.fuse_qkv else " (Q/K/V unpacked: they differ in quantization)"))
    t1 = time.perf_counter()
    try:
        build(hf, built, precision="fp32", extra_options=extra, log=log)
    except BuilderError as exc:
        raise ExportError(str(exc)) from None
    # the fp32 Hugging Face copy was the builder's input only: gone before the install writes the
    # artifact, so an export's scratch space peaks at two copies of the fp32 model, not three
    shutil.rmtree(hf)
    t2 = time.perf_counter()
    installed = install(built / "model.onnx", stage / "model.onnx", model, plan, log, decode_branch=opts.decode_branch,
                        int8_format=opts.resolved_int8_format(), last_logits=opts.last_logits,
                        verify_rows=opts.verify_tokens or 0)
    t3 = time.perf_counter()
    for f in sorted(built.iterdir()):
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy2(f, stage / f.name)
    shutil.rmtree(built)  # its fp32 graph is installed; the smoke checks run on the staged artifact
    genai = json.loads((stage / GENAI_CONFIG).read_text())
    if max_seq:
        genai["search"]["max_length"] = int(min(max_seq, genai["model"].get("context_length", max_seq)))
    if opts.prefill_chunk:  # onnxruntime-genai's Generator then prefills a long prompt in chunks (an app's too)
        genai["search"]["chunk_size"] = int(opts.prefill_chunk)
    # what the runners' sessions set, for an app's onnxruntime-genai too (it passes unknown keys on as
    # ONNX Runtime session config entries)
    genai["model"]["decoder"].setdefault("session_options", {}).update(session_config_entries(opts))
    (stage / GENAI_CONFIG).write_text(json.dumps(genai, indent=4))
    return {
        "builder": {"onnxruntime_genai": onnxruntime_genai.__version__, "precision": "fp32", "extra_options": extra},
        "installed": installed,
        "linear_schemes": _counts(plan.schemes()),
        "ops": op_counts(stage / "model.onnx"),
        **({"decode_ops": op_counts(stage / "model.onnx", "decode")} if installed["decode_branch_linears"] else {}),
        "accuracy_level": opts.accuracy_level,
        "timings_s": {"hf_folder": round(t1 - t0, 2), "builder": round(t2 - t1, 2), "install": round(t3 - t2, 2)},
        "genai_max_length": genai["search"]["max_length"],
    }


def _counts(schemes: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in schemes.values():
        out[v] = out.get(v, 0) + 1
    return out


def genai_smoke(stage: Path, ref, prompt: torch.Tensor, n: int) -> dict:
    """onnxruntime-genai's own greedy search against ``ref``'s greedy tokens (recorded, not gated:
    a quantized model may rightly diverge; the pipeline's rows measure it fully)."""
    from export.onnxruntime.genai_runner import genai_greedy

    try:
        got = genai_greedy(stage, prompt.tolist(), n)
    except Exception as exc:
        raise ExportError(f"onnxruntime-genai could not run the export: {type(exc).__name__}: {exc}") from None
    want = greedy_generate(ref, prompt, n)
    diverged = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    return {"tokens": n, "match": diverged is None and len(got) == len(want), "diverged_at": diverged}
