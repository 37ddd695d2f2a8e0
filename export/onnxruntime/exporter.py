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
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, PrivateAttr, model_validator

from targets.atomic import sha256_file
from export.base import ExportError, ExportOptions, ExportResult, Exporter
from export.onnxruntime.dynamo import calibration_windows as _calibration, io_names as _io_names, quantize_graph as _quantize
from export.onnxruntime.dynamo import torch_export as _torch_export
from export.onnxruntime.package import _ship, _versions, check_onnx
from export.onnxruntime.runner import MANIFEST, OnnxRuntimeRunner, onnx_files
from export.onnxruntime.genai_builder import FUSED_ARCHITECTURES, builder_problems
from export.onnxruntime.int8_format import Int8Format, machine_of, resolve_int8_format
from export.runtime import EagerRunner, Runner

__all__ = ["OnnxRuntimeExporter", "OnnxRuntimeOptions", "OnnxRuntimeRunner", "check_onnx", "SUPPORTED_MODEL_TYPES"]

#: model types whose HF code exports with a DynamicCache through torch.onnx, verified against eager here
DYNAMO_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "opt", "gpt_neox")
#: model types the fused graph (onnxruntime-genai's model builder) is built and verified for
FUSED_MODEL_TYPES = tuple(FUSED_ARCHITECTURES)
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys(FUSED_MODEL_TYPES + DYNAMO_MODEL_TYPES))
MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
#: auto external data above this many bytes of weights (protobuf's hard limit is 2 GiB)
EXTERNAL_DATA_AUTO_BYTES = 256 << 20


class OnnxRuntimeOptions(ExportOptions):
    graph: Literal["auto", "fused", "dynamo"] = Field(
        "auto",
        description="fused: onnxruntime-genai's model builder graph (GroupQueryAttention, SkipSimplifiedLayerNormalization, "
        f"MatMulNBits; runs in onnxruntime-genai too; {', '.join(FUSED_MODEL_TYPES)}); dynamo: torch.onnx.export of the HF "
        "code (any of " + ", ".join(DYNAMO_MODEL_TYPES) + "; needed for quantize: dynamic / static); auto: fused where it "
        "can, else dynamo",
    )
    accuracy_level: Literal[1, 4] = Field(
        4, description="MatMulNBits compute: 4 = activations quantized to int8 per block at run time (fast), "
        "1 = fp32 activations against the n-bit weights (exact against the weights, slower)",
    )
    int8_kernel: Literal["per_token", "nbits"] = Field(
        "per_token", description="fused graph, int8 per-channel weights: per_token = MatMulInteger with one activation "
        "scale per token (the 8da8w arithmetic; fast prefill), nbits = MatMulNBits 8-bit (activations per "
        "accuracy_level). A tied lm_head always takes nbits: its table then also serves the embedding",
    )
    decode_branch: bool = Field(
        True, description="fused graph, per_token int8 Linears: one-token calls take a branch running each as one "
        "DynamicQuantizeMatMul (for one token the same arithmetic as the per-token chain, one op instead of ~18)",
    )
    opset: int = Field(18, ge=18, le=23, description="ONNX opset of the dynamo graph (18..23)")
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
    reduce_range: bool = Field(False, description="7-bit weights (ORT's quantizer; the other cure for u8s8 saturation)")
    int8_format: Int8Format = Field(
        "auto", description="int8 weights of every MatMulInteger / DynamicQuantizeMatMul / QDQ MatMul: u8s8 = int8 "
        "(fastest with VNNI or on arm64; saturates on x86 without VNNI), u8u8 = the same integers as uint8 with zero "
        "point 128 (exact on every CPU), auto = u8u8 where this host's CPU is x86 without VNNI, else u8s8",
    )
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

    #: (isa, machine, device name) of the pipeline's device profile, for int8_format: auto (for_run)
    _device_cpu: tuple[tuple[str, ...], str, str] | None = PrivateAttr(None)

    def for_run(self, cfg: Any, label: str) -> "OnnxRuntimeOptions":
        """``int8_format: auto`` resolved against the run's device profile's CPU, where it names one
        (``host`` and no profile: this host's, at export)."""
        device = getattr(cfg, "device_profile", None)
        if self.int8_format != "auto" or not device or device == "host":
            return self
        from targets.devices import load_device

        profile = load_device(device)
        out = self.model_copy()
        out._device_cpu = (tuple(profile.isa), machine_of(profile.isa), profile.name)
        return out

    def resolved_int8_format(self) -> dict:
        """:func:`~export.onnxruntime.int8_format.resolve_int8_format` for these options."""
        if self._device_cpu is None:
            return resolve_int8_format(self.int8_format)
        isa, machine, name = self._device_cpu
        return resolve_int8_format(self.int8_format, isa, machine, where=f"device profile {name!r}")

    @model_validator(mode="after")
    def _per_token_options(self) -> "OnnxRuntimeOptions":
        if self.graph == "fused" and self.quantize in ("dynamic", "static"):
            raise ValueError(f"quantize: {self.quantize} is ORT's QDQ quantizer, which runs on the dynamo graph; "
                             "use graph: dynamo (or auto), or quantize: dynamic_per_token on the fused graph")
        if self.quantize == "dynamic_per_token":
            if not self.per_channel:
                raise ValueError("quantize: dynamic_per_token always uses per-channel weight scales; drop per_channel: false")
            if self.reduce_range:
                raise ValueError("quantize: dynamic_per_token stores 8-bit weights; reduce_range applies to ORT's quantizer only")
        if self.reduce_range and self.int8_format == "u8u8":
            raise ValueError("reduce_range (7-bit weights) is the u8s8 saturation workaround; int8_format: u8u8 does "
                             "not saturate, so it would only lose a bit: drop one of them")
        if self.quantize != "static" and "calibrate_method" in self.model_fields_set:
            raise ValueError(f"calibrate_method applies only to quantize: static (got quantize: {self.quantize})")
        return self


def _kv_layout(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) per layer, read from a real 2-token forward (covers GQA and MQA)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.long), past_key_values=DynamicCache(config=model.config),
                    use_cache=True)
    return [(int(l.keys.shape[1]), int(l.keys.shape[3])) for l in out.past_key_values.layers]


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
            quant = {"mode": opts.quantize, "eager_quantized_linears": len(quantized), **info["installed"],
                     "linear_schemes": info["linear_schemes"], "accuracy_level": opts.accuracy_level}
            manifest = self._manifest(stage, opts, mtype, layout, max_seq, quant, smoke, True)
            manifest.update(graph="fused", genai_config=GENAI_CONFIG, builder=info["builder"], ops=info["ops"],
                            build_timings_s=info["timings_s"])
            if "decode_ops" in info:
                manifest["decode_ops"] = info["decode_ops"]
            return manifest

        result = _ship(Path(out_dir), build_fused if graph == "fused" else build_dynamo, log)
        if graph == "fused":
            result.details.update(graph="fused", ops=result.manifest["ops"],
                                  genai_greedy=result.manifest["smoke_check"]["genai_greedy"])
            result.extra_artifacts["genai"] = Path(out_dir) / GENAI_CONFIG
            result.extra_details["genai"] = {"runtime": "onnxruntime-genai", "graph": "fused",
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


def _sliding(config) -> bool:
    return bool("sliding_attention" in (getattr(config, "layer_types", None) or ())
                or (getattr(config, "model_type", None) in ("mistral", "phi3") and getattr(config, "sliding_window", None)))


def _resolve_graph(config, opts: OnnxRuntimeOptions) -> tuple[str, list[str]]:
    """(graph that will be built, problems): one sentence per problem, naming what would work."""
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        return "fused", [f"model_type {mtype!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (fused graph: {', '.join(FUSED_MODEL_TYPES)}; "
                         f"dynamo graph: {', '.join(DYNAMO_MODEL_TYPES)})"]
    fused = builder_problems(config)
    dynamo = []
    if mtype not in DYNAMO_MODEL_TYPES:
        dynamo.append(f"model_type {mtype!r} has no dynamo graph (supported: {', '.join(DYNAMO_MODEL_TYPES)}); "
                      "use graph: fused")
    elif _sliding(config):
        dynamo.append(f"{mtype} with sliding-window attention needs the fused graph (GroupQueryAttention's local "
                      "window); the dynamo graph's cache does not slide")
    if opts.graph == "fused":
        return "fused", fused + _fused_option_problems(opts)
    if opts.graph == "dynamo":
        return "dynamo", dynamo + _dynamo_option_problems(opts)
    # auto: QDQ quantizers and families without a fused graph take dynamo; the rest fused
    if opts.quantize in ("dynamic", "static") or mtype not in FUSED_MODEL_TYPES:
        hint = ([f"quantize: dynamic_per_token runs on the fused graph instead of {opts.quantize}"]
                if dynamo and mtype in FUSED_MODEL_TYPES and not fused else [])
        return "dynamo", dynamo + hint + _dynamo_option_problems(opts)
    if fused and not dynamo:
        fused = [p + " (graph: dynamo exports it, without torchao-quantized Linears)" for p in fused]
    return "fused", fused + _fused_option_problems(opts)


#: options only one graph reads: given for the other, they would be silently ignored
_DYNAMO_ONLY = ("opset", "optimize_graph", "reduce_range", "calibrate_method", "calibration_windows")
_FUSED_ONLY = ("accuracy_level", "int8_kernel", "decode_branch")


def _fused_option_problems(opts: OnnxRuntimeOptions) -> list[str]:
    problems = []
    if opts.nodes_to_exclude:
        problems.append("nodes_to_exclude names nodes of the dynamo graph; on the fused graph use exclude_modules "
                        "(Hugging Face module patterns, e.g. '*.mlp.down_proj')")
    given = [k for k in _DYNAMO_ONLY if k in opts.model_fields_set]
    if given:
        problems.append(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only to the dynamo graph, and "
                        "this export builds the fused one; drop it, or set graph: dynamo")
    if opts.external_data == "never":
        problems.append("external_data: never is not possible on the fused graph (its weights always go to "
                        "model.onnx.data, as onnxruntime-genai expects); drop it, or set graph: dynamo")
    return problems


def _dynamo_option_problems(opts: OnnxRuntimeOptions) -> list[str]:
    given = [k for k in _FUSED_ONLY if k in opts.model_fields_set]
    if given:
        return [f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only to the fused graph, and this "
                "export builds the dynamo one; drop it, or set graph: fused"]
    return []


def _quantized_modules(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and type(m.weight) not in (torch.Tensor, torch.nn.Parameter)]


def _options(options) -> OnnxRuntimeOptions:
    return options if isinstance(options, OnnxRuntimeOptions) else OnnxRuntimeOptions.model_validate(dict(options or {}))


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
