"""What the ``onnxruntime`` block of a pipeline YAML may say, and which graph a model gets.

``optimize validate`` checks these options and :func:`_resolve_graph`'s problems (through
``OnnxRuntimeExporter.check_model``) before any stage runs; the schema and those checks live
here, apart from the export itself in :mod:`export.onnxruntime.exporter`, which re-exports them
(as :mod:`export.executorch.options` does for ExecuTorch).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from export.base import ExportOptions
from export.onnxruntime.genai_builder import FUSED_ARCHITECTURES, builder_problems
from export.onnxruntime.int8_format import Int8Format, resolve_int8_format
from targets.devices import load_device

__all__ = ["DYNAMO_MODEL_TYPES", "FUSED_MODEL_TYPES", "OnnxRuntimeOptions", "SUPPORTED_MODEL_TYPES"]

#: model types whose HF code exports with a DynamicCache through torch.onnx, verified against eager here
DYNAMO_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "opt", "gpt_neox", "mixtral", "bloom")
#: model types the fused graph (onnxruntime-genai's model builder) is built and verified for
FUSED_MODEL_TYPES = tuple(FUSED_ARCHITECTURES)
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys(FUSED_MODEL_TYPES + DYNAMO_MODEL_TYPES))


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
    last_logits: bool = Field(
        True, description="fused graph: the output logits holds the last fed position only (what generating "
        "needs; onnxruntime-genai then allocates one row per call), and every position goes to all_logits only when "
        "the input return_all_logits is true (scoring); false: logits holds every position, as the builder writes it",
    )
    verify_tokens: int | None = Field(
        None, ge=2, le=32, description="fused graph: verification calls for speculative decoding (optimize run "
        "--speculative): up to this many tokens a call, each position's logits bit for bit what a one-token call "
        "gives, through the input verify_rows (true: each GroupQueryAttention's output is its probabilities times V "
        "as one-row products; MatMulNBits blocks capped at 32 columns for 4 bits, 64 for 8, whose kernels are "
        "row-exact). It defaults to false. One-token steps then take the attention path that returns probabilities "
        "(plain decoding about 4-20% slower per step, more at long context: export with it only to decode "
        "speculatively). null (default): not added",
    )
    opset: int = Field(18, ge=18, le=23, description="ONNX opset of the dynamo graph (18..23)")
    external_data: Literal["auto", "always", "never"] = Field(
        "auto", description="weights in model.onnx.data; auto = when weights exceed 256 MiB"
    )
    optimize_graph: bool = Field(
        True, description="run onnxscript's graph optimizer in torch.onnx.export (constant folding, rewrites)"
    )
    max_seq_len: int | None = Field(None, ge=2, description="longest sequence the runner accepts (default: the model's)")
    prefill_chunk: int | None = Field(
        512, ge=1, description="a prompt is fed in calls of at most this many tokens (our runners, and "
        "onnxruntime-genai's own Generator through genai_config.json's search.chunk_size), so a full-context "
        "prompt's peak memory is the weights, the KV cache and one chunk's logits and attention; null: one call")
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
    arm64_kleidiai: bool = Field(
        False, description="let ONNX Runtime's ARM64 build run MatMulNBits through KleidiAI, which quantizes the "
        "activations per row instead of per block: faster on Arm, but not the arithmetic verified on x86-64 (SmolLM2 "
        "int4: +1.7% perplexity on an emulated Cortex-A76, against -0.01% without it). false writes the session "
        "option mlas.disable_kleidiai into the manifest and genai_config.json, so every runner and an app's "
        "onnxruntime-genai compute what was verified")
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
        profile = load_device(device)
        out = self.model_copy()
        out._device_cpu = (tuple(profile.isa), profile.arch, profile.name)
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


def _sliding(config) -> bool:
    return bool("sliding_attention" in (getattr(config, "layer_types", None) or ())
                or (getattr(config, "model_type", None) in ("mistral", "phi3", "mixtral") and getattr(config, "sliding_window", None)))


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
_FUSED_ONLY = ("accuracy_level", "int8_kernel", "decode_branch", "last_logits", "verify_tokens")


def _fused_option_problems(opts: OnnxRuntimeOptions) -> list[str]:
    problems = []
    if opts.verify_tokens and not opts.last_logits:
        problems.append("verify_tokens reads every position of a call from all_logits, which last_logits: false "
                        "does not write; drop one of them")
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


def _options(options) -> OnnxRuntimeOptions:
    return options if isinstance(options, OnnxRuntimeOptions) else OnnxRuntimeOptions.model_validate(dict(options or {}))


#: ONNX Runtime's session option that keeps MLAS's own ARM64 kernels instead of KleidiAI's
DISABLE_KLEIDIAI = "mlas.disable_kleidiai"


def session_config_entries(opts: OnnxRuntimeOptions) -> dict[str, str]:
    """Session config entries every runner of the export sets (the manifest's ``session``, and
    ``genai_config.json``'s decoder ``session_options`` for onnxruntime-genai). An x86-64 build
    ignores the KleidiAI entry: it has no KleidiAI."""
    return {} if opts.arm64_kleidiai else {DISABLE_KLEIDIAI: "1"}
