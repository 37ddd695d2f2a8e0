"""ONNX Runtime target: a decoder-only LM exported with a KV cache, int4/int8 or fp32, run on CPU.

Two graphs (``graph`` option):

- ``fused`` (default for the families onnxruntime-genai's model builder builds): the builder's
  graph of ORT's fused contrib ops (``GroupQueryAttention`` with rotary embedding,
  ``SkipSimplifiedLayerNormalization``, packed QKV), with the weights our stages chose installed
  exactly as ``MatMulNBits`` / per-token ``MatMulInteger`` / ``GatherBlockQuantized`` (see
  :mod:`export.onnxruntime.fused`), packaged with ``genai_config.json`` so ``onnxruntime_genai`` runs
  the directory as well as a plain ``InferenceSession``;
- ``dynamo``: ``torch.onnx.export(dynamo=True)`` on a thin wrapper whose inputs are flat tensors
  (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.N.key/value``); the
  wrapper rebuilds a ``DynamicCache`` so the model's own HF code runs unchanged. It serves the
  families the builder does not (GPT-2, OPT, GPT-NeoX) and ORT's own dynamic / static QDQ
  quantizer (see :mod:`export.onnxruntime.quant`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch

from targets.atomic import sha256_file
from targets.moe import export_form
from export.base import ExportError, ExportResult, Exporter
from export.onnxruntime.verify_rows import VERIFY
from export.onnxruntime.dynamo import calibration_windows as _calibration, io_names as _io_names, quantize_graph as _quantize
from export.onnxruntime.dynamo import torch_export as _torch_export
from export.onnxruntime.package import _ship, _versions, check_onnx
from export.onnxruntime.runner import MANIFEST, OnnxRuntimeRunner, onnx_files
from export.onnxruntime.options import (DYNAMO_MODEL_TYPES, FUSED_MODEL_TYPES, SUPPORTED_MODEL_TYPES, session_config_entries,
                                        OnnxRuntimeOptions, _options, _resolve_graph)
from export.decoding.runtime import EagerRunner, Runner

__all__ = ["DYNAMO_MODEL_TYPES", "FUSED_MODEL_TYPES", "OnnxRuntimeExporter", "OnnxRuntimeOptions", "OnnxRuntimeRunner",
           "check_onnx", "SUPPORTED_MODEL_TYPES"]

MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
#: auto external data above this many bytes of weights (protobuf's hard limit is 2 GiB)
EXTERNAL_DATA_AUTO_BYTES = 256 << 20


def _quantized_modules(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and type(m.weight) not in (torch.Tensor, torch.nn.Parameter)]


def _kv_layout(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) per layer, read from a real 2-token forward (covers GQA and MQA)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.long), past_key_values=DynamicCache(config=model.config),
                    use_cache=True)
    return [(int(l.keys.shape[1]), int(l.keys.shape[3])) for l in out.past_key_values.layers]


def _graph_io(path: Path) -> dict:
    """The graph's own input and output names (the fused graph takes no ``position_ids``, and the
    split head adds ``return_all_logits`` and ``all_logits``)."""
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    return {"inputs": [i.name for i in g.input], "outputs": [o.name for o in g.output]}


class OnnxRuntimeExporter(Exporter):
    name = "onnxruntime"
    options_model = OnnxRuntimeOptions
    suffixes = (".onnx",)

    def check_model(self, config, options) -> list[str]:
        """Why the graph the options and the model's config lead to cannot be built ([] = it can)."""
        return _resolve_graph(config, _options(options))[1]

    def export(self, model, tokenizer, out_dir, options=None, *, calibration: Sequence[torch.Tensor] = (), log=print):
        opts = _options(options)
        config = getattr(model, "config", None)
        mtype = getattr(config, "model_type", None)
        graph, problems = _resolve_graph(config, opts)
        if problems:
            raise ExportError("onnxruntime exporter: " + " ".join(problems))
        dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            raise ExportError(f"onnxruntime exporter needs a float32 model, got {dtype}; load it with dtype: float32 "
                              "(INT8 comes from the exporter's `quantize` option)")
        quantized = _quantized_modules(model)
        if graph == "dynamo" and quantized:
            raise ExportError(f"onnxruntime exporter: {len(quantized)} Linear(s) hold torchao quantized weights "
                              f"(e.g. {quantized[0]}); only the fused graph carries them (graph: fused)")
        calib = _calibration(opts, calibration)
        model = model.eval()
        layout = _kv_layout(model)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        external = graph == "fused" or opts.external_data == "always" or (
            opts.external_data == "auto" and weight_bytes > EXTERNAL_DATA_AUTO_BYTES)
        max_seq = opts.max_seq_len or getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

        def build_dynamo(stage: Path, work: Path) -> dict:
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
            manifest = self._manifest(stage, opts, mtype, layout, max_seq, quant, smoke, external)
            manifest["graph"] = "dynamo"
            return manifest

        def build_fused(stage: Path, work: Path) -> dict:
            from export.onnxruntime.fused_export import build_fused as fused, genai_smoke

            log(f"onnxruntime: exporting {mtype} ({len(layout)} layers) as the fused graph"
                + (f" ({len(quantized)} quantized Linears)" if quantized else ""))
            info = fused(model, tokenizer, opts, stage, work, max_seq, log)
            check_onnx(stage / MODEL_FILE)
            config.save_pretrained(str(stage))
            exact = not quantized and opts.quantize == "none"
            smoke = _smoke_check(EagerRunner(model), stage / MODEL_FILE, exact=exact)
            smoke["genai_greedy"] = genai_smoke(stage, EagerRunner(model), _SMOKE_IDS, 8)
            installed = dict(info["installed"])
            head = installed.pop("head", None)
            quant = {"mode": opts.quantize, "eager_quantized_linears": len(quantized), **installed,
                     "linear_schemes": info["linear_schemes"], "accuracy_level": opts.accuracy_level}
            manifest = self._manifest(stage, opts, mtype, layout, max_seq, quant, smoke, True)
            manifest.update(graph="fused", genai_config=GENAI_CONFIG, builder=info["builder"], ops=info["ops"],
                            build_timings_s=info["timings_s"], head=head, **_graph_io(stage / MODEL_FILE))
            if "decode_ops" in info:
                manifest["decode_ops"] = info["decode_ops"]
            if opts.verify_tokens:  # what speculative_runner() reads (export/onnxruntime/verify_rows.py)
                manifest["verify"] = {"input": VERIFY, "max_tokens": opts.verify_tokens,
                                      "attention_nodes": installed.get("verify_rows_attention", 0)}
            return manifest

        # a mixture of experts traced in the dense form (every expert on every token, weighted by its
        # routing weight: the same function without data-dependent shapes), and left as it was
        with export_form(model) as experts:
            result = _ship(Path(out_dir), build_fused if graph == "fused" else build_dynamo, log)
        if experts:
            result.details["dense_experts"] = len(experts)
        if graph == "fused":
            result.details.update(graph="fused", ops=result.manifest["ops"],
                                  genai_greedy=result.manifest["smoke_check"]["genai_greedy"])
            result.extra_artifacts["genai"] = Path(out_dir) / GENAI_CONFIG
            result.extra_details["genai"] = {"runtime": "onnxruntime-genai", "graph": "fused",
                                             "quantization": result.details.get("quantization"),
                                             "note": "the same model.onnx, run by onnxruntime_genai.Model/Generator"}
        else:
            result.details["graph"] = "dynamo"
        return result

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
        if base.get("graph", "dynamo") != "dynamo":
            raise ExportError(f"quantize_export runs ORT's quantizer on a dynamo export; {src} is the {base['graph']} "
                              "graph (export with graph: dynamo, or use quantize: dynamic_per_token in export)")
        if base.get("quantization", {}).get("mode") != "none" or base["quantization"].get("eager_quantized_linears"):
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
            manifest["graph"] = "dynamo"
            return manifest

        result = _ship(Path(out_dir), build, log)
        result.details["graph"] = "dynamo"
        return result

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
            "prefill_chunk": opts.prefill_chunk,
            "kv_cache": {"layers": len(layout), "kv_heads": [h for h, _ in layout], "head_dim": [d for _, d in layout]},
            "inputs": names_in,
            "outputs": names_out,
            "quantization": quant,
            "session": {"intra_op_threads": opts.intra_op_threads, "graph_optimization_level": opts.graph_optimization_level,
                        "config_entries": session_config_entries(opts)},
            "options": opts.model_dump(),
            "smoke_check": smoke,
            "toolchain": _versions(),
            "files": files,
        }

    def load(self, artifact, **kwargs) -> Runner:
        """``model.onnx`` -> a plain ``InferenceSession`` runner; ``genai_config.json`` or an export
        directory holding one -> the onnxruntime-genai runner (what apps run)."""
        path = Path(artifact)
        if path.is_dir() or path.name == GENAI_CONFIG:
            from export.onnxruntime.genai_runner import GenaiRunner

            directory = path if path.is_dir() else path.parent
            if not (directory / GENAI_CONFIG).is_file() and (directory / MODEL_FILE).is_file():
                return OnnxRuntimeRunner(directory / MODEL_FILE, **kwargs)
            return GenaiRunner(directory, **{k: v for k, v in kwargs.items() if k in ("max_seq_len", "intra_op_threads")})
        return OnnxRuntimeRunner(path, **kwargs)

    def artifact_in(self, directory: Path) -> Path | None:
        """The artifact ``optimize run <dir>`` loads from an export directory."""
        directory = Path(directory)
        if (directory / GENAI_CONFIG).is_file() or (directory / MODEL_FILE).is_file():
            return directory
        return None



_SMOKE_IDS = torch.arange(1, 9, dtype=torch.long) * 37 % 1000


def _smoke_check(ref: Runner, path: Path, *, exact: bool) -> dict:
    """Prefill 8 tokens then decode 1 in ORT against ``ref`` (eager, or the fp32 ONNX model): the
    decode path is the one a KV graph can silently break. fp32 must match; logits must be finite."""
    runner = OnnxRuntimeRunner(path, max_seq_len=None)
    ids = _SMOKE_IDS
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
