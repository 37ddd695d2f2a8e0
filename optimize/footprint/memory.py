"""What an exported artifact needs in memory, measured rather than guessed.

Three figures per export row (:class:`MemoryFootprint`, in ``Metrics.memory``):

- ``artifact_bytes``: the shipped files (the runner's ``size_bytes``);
- ``kv_cache_bytes``: the KV cache at ``max_seq_len``, from the model config:
  layers x 2 (K and V) x kv_heads x head_dim x max_seq_len x bytes of the cache dtype
  (:func:`kv_cache_bytes`; per-layer heads/head_dim where the config has them);
- ``peak_rss_bytes``: the peak resident memory of a **child process** (``python -m
  optimize.footprint.memory ARTIFACT ...``) that loads the artifact in its runtime, prefills ``max_seq_len -
  decode`` tokens and decodes ``decode`` more (so the cache is full at the end), read from the
  kernel's high-water mark (``VmHWM``, reset after the imports where ``/proc/self/clear_refs``
  allows, else ``ru_maxrss``). Nothing of the pipeline's own process counts. The child's resident
  memory after importing torch and the runtime and before loading the artifact is reported apart
  (``interpreter_rss_bytes``): a phone app embedding the C++ runtime does not carry Python and
  torch, so ``peak_rss_bytes - interpreter_rss_bytes`` (``model_rss_bytes``) is what the artifact
  adds, and what a device's usable memory is compared with (:mod:`optimize.footprint.predict`).

``predicted_peak_rss_bytes`` is the simple model the measurement checks (:func:`predicted_peak`):
interpreter + artifact + the backend's packed copy of the Linear weights + KV cache + one prefill
call's attention scores + the largest call's logits; the report gives both, their difference and
the model's parts (``predicted_parts``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from export.base import get_exporter
from targets.process_memory import reset_peak_rss, status_bytes

MARKER = "OPTIMIZE_MEMORY_JSON "
MIB = 2**20


class MemoryFootprint(BaseModel):
    """An export row's memory: sizes computed, peak measured in a child process."""

    artifact_bytes: int | None = Field(None, description="the shipped files, bytes")
    kv_cache_bytes: int | None = Field(
        None, description="KV cache at max_seq_len: layers x 2 x kv_heads x head_dim x max_seq_len x dtype bytes")
    kv_cache_dtype: str = Field("float32", description="dtype the runtime's cache holds")
    max_seq_len: int | None = Field(None, description="positions the cache holds")
    peak_rss_bytes: int | None = Field(
        None, description="measured: peak resident memory of the child that loaded the artifact and ran prefill + decode")
    interpreter_rss_bytes: int | None = Field(
        None, description="measured: the child's resident memory after importing torch and the runtime, before loading")
    model_rss_bytes: int | None = Field(None, description="peak_rss_bytes - interpreter_rss_bytes: what the artifact adds")
    predicted_peak_rss_bytes: int | None = Field(
        None, description="predicted: interpreter + artifact + the backend's packed copy of the weights + KV cache "
        "(twice in an ONNX Runtime InferenceSession: past in, present out) + one prefill call's attention scores + "
        "the largest call's logits (the model the measurement checks)")
    predicted_parts: dict[str, int] | None = Field(
        None, description="the prediction's terms, bytes: interpreter, runtime, artifact, packed, kv_cache, attention, "
        "logits")
    prefill_tokens: int | None = None
    decode_tokens: int | None = None
    peak_source: str | None = Field(None, description="VmHWM (reset after imports), or ru_maxrss (whole child)")
    child_s: float | None = Field(None, description="seconds the child ran")
    error: str | None = Field(None, description="why the peak was not measured")

    @property
    def prediction_error_pct(self) -> float | None:
        if not self.peak_rss_bytes or self.predicted_peak_rss_bytes is None:
            return None
        return 100.0 * (self.predicted_peak_rss_bytes / self.peak_rss_bytes - 1.0)


# ---- computed -------------------------------------------------------------------------------

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "float8": 1}


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def kv_shapes(config: Any) -> tuple[list[int], list[int]]:
    """(kv_heads, head_dim) per layer from a transformers config (a dict works too)."""
    if isinstance(config, dict):
        from transformers import AutoConfig

        d = dict(config)
        config = AutoConfig.for_model(d.pop("model_type"), **d)
    cfg = _text_config(config)
    layers = int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer"))
    try:
        from transformers.configuration_utils import get_head_shapes

        heads, dims = get_head_shapes(cfg)
    except Exception:  # older transformers, or a config without per_layer_config
        n_heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head")
        heads = getattr(cfg, "num_key_value_heads", None) or n_heads
        hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
        dims = getattr(cfg, "head_dim", None) or hidden // n_heads
    heads = list(heads) if isinstance(heads, list) else [int(heads)] * layers
    dims = list(dims) if isinstance(dims, list) else [int(dims)] * layers
    return heads, dims


def kv_cache_bytes(config: Any, max_seq_len: int, dtype: str = "float32", positions: int | None = None) -> int:
    """Bytes of the K and V caches of every layer at ``max_seq_len`` positions (or ``positions``):
    sum over layers of 2 x kv_heads x head_dim x positions x bytes of ``dtype``. Sliding-window
    layers are counted in full (an upper bound: ExecuTorch's ring layers hold 2 x window)."""
    heads, dims = kv_shapes(config)
    n = max_seq_len if positions is None else positions
    return sum(2 * h * d * n * _DTYPE_BYTES[dtype] for h, d in zip(heads, dims))


#: what onnxruntime-genai's ``og.Model`` holds beyond an ``InferenceSession`` of the same graph, measured
#: at load: 16 MiB for the tiny test Llama (49.6 against 33.6 MiB) and for SmolLM2 W8A8 (331 against 315)
GENAI_LOAD_BYTES = 16 * MIB


def predicted_parts(interpreter: int, artifact: int, kv: int, *, packed: int = 0, vocab: int | None = None,
                    logits_rows: int = 1, logits_copies: int = 1, kv_copies: int = 1, attention: int = 0,
                    runtime: int = 0) -> dict[str, int]:
    """The memory model the measurement checks, term by term: the interpreter and runtime, the
    artifact resident once, what the backend copies at load (``packed``,
    :func:`optimize.footprint.predict.packed_copy_bytes`: XNNPACK's and MLAS's packed weights, ONNX
    Runtime's transposed tied table), the full KV cache ``kv_copies`` times (2 where the graph takes
    the past as an input and returns the present as a new output, as an ``InferenceSession`` does:
    the last call holds both; 1 where the cache is updated in place, in ExecuTorch and
    onnxruntime-genai's shared buffers), one prefill call's ``attention`` scores (ONNX Runtime's
    ``GroupQueryAttention`` writes heads x chunk x context float32 scores before its softmax:
    :func:`attention_scratch_bytes`), and the largest call's float32 logits (``logits_rows`` x
    ``vocab``, ``logits_copies`` times: how many the runtime and its bindings hold at once), and what
    the runtime itself holds beyond that (``runtime``: :data:`GENAI_LOAD_BYTES` for onnxruntime-genai)."""
    return {"interpreter": int(interpreter), "runtime": int(runtime), "artifact": int(artifact), "packed": int(packed),
            "kv_cache": int(kv * kv_copies), "attention": int(attention),
            "logits": int(4 * (vocab or 0) * logits_rows * logits_copies)}


def predicted_peak(interpreter: int, artifact: int, kv: int, **terms) -> int:
    """The sum of :func:`predicted_parts`."""
    return sum(predicted_parts(interpreter, artifact, kv, **terms).values())


def attention_scratch_bytes(config: Any, chunk_tokens: int | None, context: int, runtime: str) -> int:
    """What one prefill call's attention holds at once in an ONNX Runtime ``InferenceSession``: its
    CPU ``GroupQueryAttention`` fills a float32 ``heads x chunk x (past + chunk)`` score buffer for
    the softmax, largest at the last chunk of a full-context prompt. Measured on SmolLM2 W8A8
    (9 heads, chunks of 512): the peak beyond the weights and both KV copies grew 31, 48 and 104 MiB
    at 2048, 4096 and 8192 tokens, against 36, 72 and 144 priced. onnxruntime-genai's calls did not
    grow with the context at all (the same peak, within 7 MiB, at 2048, 4096 and 8192 tokens of
    the same model), and ExecuTorch's custom SDPA tiles its scores: 0 for both."""
    if not chunk_tokens or runtime != "onnxruntime" or config is None:
        return 0
    cfg = config if isinstance(config, dict) else _text_config(config)
    get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    heads = int(get("num_attention_heads") or get("n_head") or 0)
    return 4 * heads * int(chunk_tokens) * int(context)


# ---- measured in a child --------------------------------------------------------------------


def exporter_path(exporter: Any) -> str:
    """``module:Class`` of an exporter instance, for the child to import."""
    cls = type(exporter)
    return f"{cls.__module__}:{cls.__qualname__}"


def measure_peak(artifact: Path, exporter: str, *, max_seq_len: int | None = None, decode_tokens: int = 4,
                 threads: int = 1, timeout_s: float = 900.0) -> dict:
    """Run the child on ``artifact`` (``exporter`` is ``module:Class`` or a registered exporter name)
    and return its figures: ``peak_rss_bytes``, ``interpreter_rss_bytes``, ``prefill_tokens``,
    ``decode_tokens``, ``max_seq_len``, ``peak_source``, ``child_s``; or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "optimize.footprint.memory", str(artifact), "--exporter", exporter,
           "--decode", str(decode_tokens), "--threads", str(threads)]
    if max_seq_len:
        cmd += ["--max-seq-len", str(max_seq_len)]
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([here, *[p for p in sys.path if p], env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", "1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"the memory child ran past {timeout_s:.0f} s"}
    wall = round(time.perf_counter() - t0, 2)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            out = json.loads(line[len(MARKER):])
            out["child_s"] = wall
            return out
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"the memory child exited {proc.returncode} without figures: {tail}", "child_s": wall}


def footprint(artifact: Path, exporter: Any, config: Any, *, artifact_bytes: int | None, max_seq_len: int | None,
              kv_dtype: str = "float32", packed_bytes: int | None = None, decode_tokens: int = 4,
              threads: int = 1) -> MemoryFootprint:
    """The row's :class:`MemoryFootprint`: sizes computed, the peak measured in a child, and the
    :func:`predicted_peak` beside it (``packed_bytes``: the weights the backend repacks)."""
    name = exporter if isinstance(exporter, str) else exporter_path(exporter)
    got = measure_peak(artifact, name, max_seq_len=max_seq_len, decode_tokens=decode_tokens, threads=threads)
    n = got.get("max_seq_len") or max_seq_len
    kv = kv_cache_bytes(config, n, kv_dtype) if n and config is not None else None
    fp = MemoryFootprint(artifact_bytes=artifact_bytes, kv_cache_bytes=kv, kv_cache_dtype=kv_dtype, max_seq_len=n,
                         **{k: got.get(k) for k in ("peak_rss_bytes", "interpreter_rss_bytes", "prefill_tokens",
                                                    "decode_tokens", "peak_source", "child_s", "error")})
    if fp.peak_rss_bytes is not None and fp.interpreter_rss_bytes is not None:
        fp.model_rss_bytes = max(0, fp.peak_rss_bytes - fp.interpreter_rss_bytes)
        if artifact_bytes is not None and kv is not None:
            attention = attention_scratch_bytes(config, got.get("chunk_tokens"), n, got.get("runtime") or "")
            parts = predicted_parts(
                fp.interpreter_rss_bytes, artifact_bytes, kv, packed=packed_bytes or 0,
                vocab=got.get("vocab_size") or _vocab(config), logits_rows=got.get("logits_rows") or 1,
                logits_copies=got.get("logits_copies") or 1, kv_copies=got.get("kv_copies") or 1, attention=attention,
                runtime=GENAI_LOAD_BYTES if got.get("runtime") == "onnxruntime-genai" else 0)
            fp.predicted_parts = parts
            fp.predicted_peak_rss_bytes = sum(parts.values())
    return fp


def _vocab(config: Any) -> int | None:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get("vocab_size")
    return getattr(_text_config(config), "vocab_size", None)


# ---- the child ------------------------------------------------------------------------------


def _warm_imports(exporter_name: str, artifact: Path) -> None:
    """Import what loading the artifact would import, so the baseline holds the runtime and the
    peak's excess is the artifact's."""
    import importlib

    if exporter_name in ("executorch", "torchchat") or artifact.suffix == ".pte":
        import executorch.kernels.quantized  # noqa: F401
        from executorch.runtime import Runtime

        Runtime.get()
        if artifact.suffix == ".pte":
            from export.executorch import load_llama_custom_ops, uses_llama_custom_ops

            if uses_llama_custom_ops(artifact):
                load_llama_custom_ops()
    if exporter_name == "onnxruntime" or artifact.suffix == ".onnx":
        import onnxruntime  # noqa: F401

    for mod in (f"export.{exporter_name}.runner",):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass


def _child(argv: list[str] | None = None) -> int:
    import argparse
    import gc
    import importlib

    p = argparse.ArgumentParser(prog="python -m optimize.footprint.memory",
                                description="peak resident memory of loading an artifact and running prefill + decode")
    p.add_argument("artifact")
    p.add_argument("--exporter", required=True, help="registered exporter name or module:Class")
    p.add_argument("--max-seq-len", type=int, default=None, help="for runners that hold no limit themselves")
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    artifact = Path(args.artifact)

    import torch

    torch.set_num_threads(args.threads)
    if ":" in args.exporter:
        mod, _, cls = args.exporter.partition(":")
        exporter = getattr(importlib.import_module(mod), cls)()
    else:
        exporter = get_exporter(args.exporter)
    _warm_imports(exporter.name, artifact)
    gc.collect()
    interpreter = status_bytes("VmRSS")
    reset = reset_peak_rss()

    runner = exporter.load(artifact)
    n = runner.max_seq_len or args.max_seq_len
    if not n:
        raise SystemExit("the runner holds no max_seq_len; pass --max-seq-len")
    decode = max(1, min(args.decode, n - 1))
    prefill = n - decode
    vocab = getattr(runner, "vocab_size", None) or 100
    ids = torch.arange(prefill, dtype=torch.long) % max(2, int(vocab) - 1) + 1
    with torch.inference_mode():
        runner.reset()
        logits = runner.forward(ids, all_logits=False)
        for _ in range(decode):
            nxt = int(torch.argmax(logits[-1]).item())
            logits = runner.forward(torch.tensor([nxt], dtype=torch.long), all_logits=False)
    hwm, rss = status_bytes("VmHWM"), status_bytes("VmRSS")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if reset and hwm is not None:
        peak, source = max(hwm, rss or 0), "VmHWM (reset after the imports)"
    else:
        peak, source = maxrss, "ru_maxrss (the whole child, imports included)"
    # rows of float32 logits the runtime makes in the largest call: one where the graph computes the
    # head on the last position only (export/onnxruntime/last_logits.py), else every position of one
    # prefill call in ONNX Runtime's graph (a chunk of prefill_chunk positions where the export has
    # one, else the whole prompt), of which onnxruntime-genai holds about three copies (measured on
    # this project's exports, 3.0x the logits' bytes per prefill token); a .pte's chunk when it
    # returns every position, else one
    rows, copies, kv_copies, chunk_tokens = 1, 1, 1, None
    if runner.runtime in ("onnxruntime", "onnxruntime-genai"):
        chunk = getattr(runner, "prefill_chunk", None)
        chunk_tokens = min(int(chunk), prefill) if chunk else prefill
        rows = 1 if getattr(runner, "last_logits", False) else chunk_tokens
        copies = 3 if runner.runtime == "onnxruntime-genai" and rows > 1 else 1
        # an InferenceSession's last call holds the past it was fed and the present it returns
        kv_copies = 2 if runner.runtime == "onnxruntime" else 1
    elif hasattr(runner, "all_positions"):
        rows = min(int(runner.max_chunk), prefill) if runner.all_positions else 1
    out = {"peak_rss_bytes": int(peak), "interpreter_rss_bytes": interpreter, "prefill_tokens": prefill,
           "logits_rows": rows, "logits_copies": copies, "chunk_tokens": chunk_tokens, "kv_copies": kv_copies, "vocab_size": int(vocab) if getattr(runner, "vocab_size", None) else None,
           "decode_tokens": decode, "max_seq_len": int(n), "peak_source": source, "runtime": runner.runtime,
           "threads": args.threads}
    runner.close()
    print(MARKER + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
