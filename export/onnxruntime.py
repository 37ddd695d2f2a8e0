"""ONNX Runtime target: a decoder-only LM exported with a KV cache, optionally INT8, run on CPU.

Route: ``torch.onnx.export(dynamo=True)`` (torch.export + onnxscript) on a thin wrapper whose
inputs are flat tensors (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.N.key/value``) and whose outputs are ``logits`` and ``present.N.key/value``.
The wrapper rebuilds a ``DynamicCache`` from the past tensors, so the model's own HF code runs
unchanged and one graph serves prefill (empty past) and decode (past from the previous call).
INT8 is ORT's own quantizer applied to that graph (see :mod:`export.onnx_quant`).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Literal, Sequence

import torch
from pydantic import Field, model_validator

from targets.atomic import atomic_write_json, sha256_file
from export.base import ExportError, ExportOptions, ExportResult, Exporter
from export.onnx_runner import MANIFEST, OnnxRuntimeRunner, onnx_files
from export.runtime import EagerRunner, Runner

__all__ = ["OnnxRuntimeExporter", "OnnxRuntimeOptions", "OnnxRuntimeRunner", "check_onnx", "SUPPORTED_MODEL_TYPES"]

#: model types whose HF code exports with a DynamicCache and was verified against eager here
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "opt", "gpt_neox")
MODEL_FILE = "model.onnx"
#: auto external data above this many bytes of weights (protobuf's hard limit is 2 GiB)
EXTERNAL_DATA_AUTO_BYTES = 256 << 20


class OnnxRuntimeOptions(ExportOptions):
    opset: int = Field(18, ge=18, le=23, description="ONNX opset (18..23)")
    external_data: Literal["auto", "always", "never"] = Field(
        "auto", description="weights in model.onnx.data; auto = when weights exceed 256 MiB"
    )
    optimize_graph: bool = Field(
        True, description="run onnxscript's graph optimizer in torch.onnx.export (constant folding, rewrites)"
    )
    max_seq_len: int | None = Field(None, ge=2, description="longest sequence the runner accepts (default: the model's)")
    quantize: Literal["none", "dynamic", "dynamic_per_token", "static"] = Field(
        "none",
        description="INT8: dynamic (ORT's quantizer; one activation scale per tensor at run time), "
        "dynamic_per_token (weights int8 per channel, one activation scale per token, as XNNPACK's 8da8w; "
        "standard ONNX ops), or static (ORT's QDQ with calibrated per-tensor activation ranges)",
    )
    per_channel: bool = Field(True, description="per-output-channel weight scales")
    reduce_range: bool = Field(False, description="7-bit weights (for non-VNNI CPUs that saturate u8s8)")
    calibrate_method: Literal["minmax", "entropy", "percentile"] = Field("minmax", description="static calibration")
    calibration_windows: int = Field(8, ge=1, description="at most this many calibration windows are used")
    quantize_lm_head: bool = Field(False, description="also quantize the output projection (tied ones are untied)")
    quantize_embedding: bool = Field(False, description="store the embedding table int8 with one scale per row")
    nodes_to_exclude: list[str] = Field(default_factory=list, description="extra ONNX node names to keep fp32")
    exclude_modules: list[str] = Field(
        default_factory=list, description="HF module paths (fnmatch, e.g. '*.mlp.down_proj') whose MatMuls stay fp32"
    )
    intra_op_threads: int = Field(0, ge=0, description="ORT intra-op threads the runner uses; 0 = torch's setting")
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="ORT session graph optimizations the runner uses"
    )

    @model_validator(mode="after")
    def _per_token_options(self) -> "OnnxRuntimeOptions":
        if self.quantize == "dynamic_per_token":
            if not self.per_channel:
                raise ValueError("quantize: dynamic_per_token always uses per-channel weight scales; drop per_channel: false")
            if self.reduce_range:
                raise ValueError("quantize: dynamic_per_token stores 8-bit weights; reduce_range applies to ORT's quantizer only")
        if self.quantize != "static" and "calibrate_method" in self.model_fields_set:
            raise ValueError(f"calibrate_method applies only to quantize: static (got quantize: {self.quantize})")
        return self


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def check_onnx(path: Path) -> None:
    """``onnx.checker`` on the path (so external data is followed); failure never ships."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:  # ValidationError, or a load error for a broken file
        raise ExportError(f"ONNX checker rejected {Path(path).name}: {exc}") from None


def _kv_layout(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) per layer, read from a real 2-token forward (covers GQA and MQA)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.long), past_key_values=DynamicCache(config=model.config),
                    use_cache=True)
    return [(int(l.keys.shape[1]), int(l.keys.shape[3])) for l in out.past_key_values.layers]


class _KVWrapper(torch.nn.Module):
    """Flat tensors in, flat tensors out: the signature ONNX consumers (and optimum) expect."""

    def __init__(self, model: torch.nn.Module, n_layers: int):
        super().__init__()
        self.model, self.n_layers = model, n_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def _io_names(n_layers: int) -> tuple[list[str], list[str]]:
    kv = [(i, k) for i in range(n_layers) for k in ("key", "value")]
    return (["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{i}.{k}" for i, k in kv],
            ["logits"] + [f"present.{i}.{k}" for i, k in kv])


def _torch_export(model: torch.nn.Module, layout: list[tuple[int, int]], path: Path, opset: int, external: bool,
                  optimize: bool = True) -> None:
    """Trace with dynamic batch, sequence and past axes; a real past (3 tokens) avoids 0/1
    specialization, and ORT accepts an empty past at run time for prefill."""
    from torch.export import Dim
    from transformers import DynamicCache

    n = len(layout)
    b, s, p, tot = Dim("batch"), Dim("seq"), Dim("past_seq"), Dim("total_seq")
    with torch.no_grad():
        pre = model(input_ids=torch.arange(6, dtype=torch.long).reshape(2, 3) + 1,
                    past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
    past = [t.contiguous() for l in pre.layers for t in (l.keys, l.values)]
    ids = torch.arange(10, dtype=torch.long).reshape(2, 5) + 7
    args = (ids, torch.ones(2, 8, dtype=torch.long), torch.arange(3, 8).expand(2, 5).contiguous(), *past)
    shapes = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: tot}, "position_ids": {0: b, 1: s},
              "past": tuple({0: b, 2: p} for _ in past)}
    names_in, names_out = _io_names(n)
    with torch.no_grad():
        prog = torch.onnx.export(_KVWrapper(model, n), args, dynamo=True, dynamic_shapes=shapes, opset_version=opset,
                                 input_names=names_in, output_names=names_out, optimize=optimize, verbose=False)
    prog.save(str(path), external_data=external)


class OnnxRuntimeExporter(Exporter):
    name = "onnxruntime"
    options_model = OnnxRuntimeOptions
    suffixes = (".onnx",)

    def export(self, model, tokenizer, out_dir, options=None, *, calibration: Sequence[torch.Tensor] = (), log=print):
        opts = _options(options)
        config = getattr(model, "config", None)
        mtype = getattr(config, "model_type", None)
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ExportError(f"onnxruntime exporter does not support model_type {mtype!r}; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            raise ExportError(f"onnxruntime exporter: {mtype} with sliding-window attention layers is not supported "
                              "(its cache is not a plain growing KV cache); disable sliding_window in the config")
        dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            raise ExportError(f"onnxruntime exporter needs a float32 model, got {dtype}; load it with dtype: float32 "
                              "(INT8 comes from the exporter's `quantize` option)")
        calib = _calibration(opts, calibration)
        model = model.eval()
        layout = _kv_layout(model)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        external = opts.external_data == "always" or (opts.external_data == "auto" and weight_bytes > EXTERNAL_DATA_AUTO_BYTES)
        max_seq = opts.max_seq_len or getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

        def build(stage: Path, work: Path) -> dict:
            log(f"onnxruntime: exporting {mtype} ({weight_bytes / 2**20:.0f} MiB fp32, {len(layout)} layers) "
                f"with torch.onnx dynamo, opset {opts.opset}")
            fp32_path = (work if opts.quantize != "none" else stage) / MODEL_FILE
            try:
                _torch_export(model, layout, fp32_path, opts.opset, external, opts.optimize_graph)
            except Exception as exc:
                raise ExportError(f"torch.onnx.export failed for {mtype}: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
            check_onnx(fp32_path)
            quant = _quantize(fp32_path, stage / MODEL_FILE, opts, calib, layout, external, work, log)
            tokenizer.save_pretrained(str(stage))
            config.save_pretrained(str(stage))
            smoke = _smoke_check(EagerRunner(model), stage / MODEL_FILE, exact=opts.quantize == "none")
            return self._manifest(stage, opts, mtype, layout, max_seq, quant, smoke, external)

        return _ship(Path(out_dir), build, log)

    def quantize_export(self, fp32_artifact, out_dir, options=None, *, calibration: Sequence[torch.Tensor] = (),
                        log=print) -> ExportResult:
        """INT8 from an fp32 export already on disk, without tracing the model again (tracing is
        the slow part of an export). The tokenizer and config are copied from beside it."""
        opts = _options(options)
        if opts.quantize == "none":
            raise ExportError("quantize_export needs quantize: dynamic or static; got 'none'")
        src = Path(fp32_artifact)
        try:
            base = json.loads((src.parent / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise ExportError(f"quantize_export needs the manifest of an fp32 export beside {src}: {exc}") from None
        if base.get("quantization", {}).get("mode") != "none":
            raise ExportError(f"{src} is already quantized ({base['quantization'].get('mode')}); start from an fp32 export")
        calib = _calibration(opts, calibration)
        kv = base["kv_cache"]
        layout = list(zip(kv["kv_heads"], kv["head_dim"]))

        def build(stage: Path, work: Path) -> dict:
            quant = _quantize(src, stage / MODEL_FILE, opts, calib, layout, base["external_data"], work, log)
            for name in base["files"]:
                if name not in {f.name for f in onnx_files(src)}:
                    shutil.copy2(src.parent / name, stage / name)
            smoke = _smoke_check(OnnxRuntimeRunner(src, max_seq_len=None), stage / MODEL_FILE, exact=False)
            manifest = self._manifest(stage, opts.model_copy(update={"opset": base["opset"]}), base["model_type"], layout,
                                      opts.max_seq_len or base["max_seq_len"], quant, smoke, base["external_data"])
            manifest["source"] = {"artifact": str(src), "sha256": base["files"][src.name]["sha256"]}
            return manifest

        return _ship(Path(out_dir), build, log)

    @staticmethod
    def _manifest(stage: Path, opts: OnnxRuntimeOptions, mtype: str, layout, max_seq, quant, smoke, external) -> dict:
        files = {f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
                 for f in sorted(stage.iterdir()) if f.is_file() and f.name != MANIFEST}
        model_files = [f.name for f in onnx_files(stage / MODEL_FILE)]
        names_in, names_out = _io_names(len(layout))
        return {
            "format": "onnx",
            "runtime": "onnxruntime",
            "artifact": MODEL_FILE,
            "model_type": mtype,
            "opset": opts.opset,
            "external_data": external,
            "size_bytes": sum(files[f]["bytes"] for f in model_files),
            "max_seq_len": max_seq,
            "kv_cache": {"layers": len(layout), "kv_heads": [h for h, _ in layout], "head_dim": [d for _, d in layout]},
            "inputs": names_in,
            "outputs": names_out,
            "quantization": quant,
            "session": {"intra_op_threads": opts.intra_op_threads, "graph_optimization_level": opts.graph_optimization_level},
            "options": opts.model_dump(),
            "smoke_check": smoke,
            "toolchain": _versions(),
            "files": files,
        }

    def load(self, artifact, **kwargs) -> "OnnxRuntimeRunner":
        return OnnxRuntimeRunner(Path(artifact), **kwargs)


def _options(options) -> OnnxRuntimeOptions:
    return options if isinstance(options, OnnxRuntimeOptions) else OnnxRuntimeOptions.model_validate(dict(options or {}))


def _calibration(opts: OnnxRuntimeOptions, calibration: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if opts.quantize == "static" and not calibration:
        raise ExportError("quantize: static needs calibration windows (real text token ids); got none")
    return [torch.as_tensor(w, dtype=torch.long).reshape(-1) for w in calibration][: opts.calibration_windows]


def _quantize(src: Path, dst: Path, opts: OnnxRuntimeOptions, calib, layout, external: bool, work: Path, log) -> dict:
    if opts.quantize == "none":
        return {"mode": "none"}
    from export import onnx_quant

    log(f"onnxruntime: quantizing ({opts.quantize}"
        + (f", {opts.calibrate_method} on {len(calib)} windows" if opts.quantize == "static" else "") + ")")
    specs = {f"past_key_values.{i}.{k}": layout[i] for i in range(len(layout)) for k in ("key", "value")}
    try:
        quant = onnx_quant.quantize(
            src, dst, mode=opts.quantize, per_channel=opts.per_channel, reduce_range=opts.reduce_range,
            calibrate_method=opts.calibrate_method, quantize_lm_head=opts.quantize_lm_head,
            quantize_embedding=opts.quantize_embedding, nodes_to_exclude=opts.nodes_to_exclude, exclude_modules=opts.exclude_modules, calibration=calib,
            past_specs=specs, external_data=external, work_dir=work,
        )
    except Exception as exc:
        raise ExportError(f"ONNX Runtime {opts.quantize} quantization failed: {type(exc).__name__}: {exc}") from exc
    check_onnx(dst)
    return quant


def _ship(out_dir: Path, build, log) -> ExportResult:
    """Build into a private temp dir inside ``out_dir``, then rename each file into place.

    The manifest goes last (and an old one goes first), so a directory whose manifest verifies
    is complete; a failed build leaves ``out_dir`` as it was.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".onnx-export.", dir=out_dir))
    try:
        stage, work = tmp / "ship", tmp / "work"
        stage.mkdir()
        work.mkdir()
        manifest = build(stage, work)
        atomic_write_json(stage / MANIFEST, manifest)
        old = _old_files(out_dir)
        (out_dir / MANIFEST).unlink(missing_ok=True)
        for f in sorted(stage.iterdir(), key=lambda p: p.name == MANIFEST):
            os.replace(f, out_dir / f.name)
        for name in old - set(manifest["files"]) - {MANIFEST}:  # e.g. a stale model.onnx.data
            (out_dir / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"onnxruntime: wrote {out_dir / MODEL_FILE} ({manifest['size_bytes'] / 2**20:.1f} MiB)")
    return ExportResult(artifact=out_dir / MODEL_FILE,
                        files=[out_dir / name for name in manifest["files"]] + [out_dir / MANIFEST],
                        manifest=manifest,
                        details={"quantization": manifest["quantization"], "smoke": manifest["smoke_check"],
                                 "external_data": manifest["external_data"], "toolchain": manifest["toolchain"]})


def _old_files(out_dir: Path) -> set[str]:
    """Files a previous export listed in ``out_dir``'s manifest (only those are ever removed)."""
    try:
        return {n for n in json.loads((out_dir / MANIFEST).read_text())["files"] if "/" not in n}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _smoke_check(ref: Runner, path: Path, *, exact: bool) -> dict:
    """Prefill 8 tokens then decode 1 in ORT against ``ref`` (eager, or the fp32 ONNX model): the
    decode path is the one a KV graph can silently break. fp32 must match; logits must be finite."""
    runner = OnnxRuntimeRunner(path, max_seq_len=None)
    ids = torch.arange(1, 9, dtype=torch.long) * 37 % 1000
    got = [runner.forward(ids), runner.forward(torch.tensor([5]))]
    runner.close()
    if not all(torch.isfinite(g).all() for g in got):
        raise ExportError(f"{path.name}: ONNX Runtime produced non-finite logits on the smoke check")
    ref.reset()
    want = [ref.forward(ids), ref.forward(torch.tensor([5]))]
    diff = max(float((g - r).abs().max()) for g, r in zip(got, want))
    if exact and diff > 1e-2:
        raise ExportError(f"{path.name}: fp32 ONNX logits differ from eager by {diff:.3g} (prefill+decode smoke check)")
    return {"reference": ref.runtime, "max_abs_diff": diff, "decode_top1_match": bool(got[1].argmax() == want[1].argmax())}
