"""What the ``executorch`` block of a pipeline YAML may say, and what a model's config shows the
ExecuTorch exporter cannot do with it.

``optimize validate`` runs :func:`model_problems` (through ``ExecuTorchExporter.check_model``)
before any stage; the schema and those checks live here, apart from the lowering in
:mod:`export.executorch.exporter`, which re-exports them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from export.base import ExportOptions
from targets.group_size import embedding_width_error, group_size_error, widths_error


class ExecuTorchOptions(ExportOptions):
    """The ``executorch`` block of a pipeline YAML."""

    #: the pipeline fills ``max_seq_len`` from the target profile when the YAML leaves it out
    max_seq_len_from_profile: ClassVar[bool] = True

    quantize: Literal["none", "8da4w", "8da8w"] = Field(
        "none",
        description="exporter-side quantization of nn.Linear layers: none (export the model as given, "
        "including weights an earlier ptq stage quantized), 8da4w (int8 dynamic activations, int4 "
        "group-wise weights) or 8da8w (int8 dynamic activations, int8 per-channel weights)",
    )
    group_size: int = Field(
        32, gt=0, description="weight group size for 8da4w; must divide every quantized layer's in_features"
    )
    lm_head: Literal["same", "fp32", "8da8w"] = Field(
        "same",
        description="precision of the output projection when quantize is set: same as the other layers, "
        "fp32, or 8da8w (int4 on lm_head costs most of 8da4w's perplexity loss)",
    )
    attention: Literal["same", "8da8w", "fp32"] = Field(
        "same",
        description="precision of the attention projections (every Linear under a module named attn, "
        "self_attn, attention or self_attention) when quantize is set: same as the other layers, 8da8w or "
        "fp32. Attention int8 beside an int4 MLP sits between all-int8 and all-int4 in bytes and accuracy",
    )
    embedding_quantize: Literal["auto", "int8", "int4"] | None = Field(
        "auto",
        description="weight-only quantization of the token embedding table (portable quantized "
        "embedding kernel): int8 per row, int4 group-wise, null keeps it fp32, auto (default) = int8 "
        "when the Linear layers are quantized and the fp32 table would be at least a quarter of the program",
    )
    embedding_group_size: int = Field(
        32, gt=0, description="group size for int4 embedding quantization; must divide hidden_size"
    )
    max_seq_len: int | None = Field(
        None, ge=2, description="KV-cache length (prompt + generation); null takes the target profile's"
    )
    dtype: Literal["float32"] = Field(
        "float32",
        description="dtype the exporter casts the model's floating weights, activations and KV cache to "
        "(a bfloat16 model is exported in float32); only float32 is verified on XNNPACK here",
    )
    weights: Literal["embedded", "external"] = Field(
        "embedded",
        description="where the weights live: embedded (one self-contained model.pte) or external (a small "
        "model.pte plus model.ptd, loaded together; identical tensors are stored once, so a tied embedding "
        "and lm_head of the same precision share storage, which a single .pte cannot do)",
    )
    logits: Literal["last", "all"] = Field(
        "last",
        description="positions forward returns logits for: last (default; what generation and ExecuTorch's "
        "runner read, so prefill skips the output projection for the rest of the prompt: 128 prompt tokens "
        "x a 49k vocabulary is a third of SmolLM2's prefill) or all (every fed position; perplexity in the "
        "runtime then takes one call per chunk instead of one per token)",
    )
    scoring_method: bool | None = Field(
        None,
        description="with logits: last, also export forward_all: the same weights (stored once) returning every "
        "fed position's logits, so lm-eval scoring (checks.tasks) feeds a continuation in one call instead of "
        "one call per token. null (default): exported when checks.tasks scores the export row. Costs a second "
        "lowering at export time and, once loaded, a second copy of XNNPACK's packed weights in memory",
    )
    verify_tokens: int | None = Field(
        None,
        ge=2,
        le=32,
        description="also export verify: up to this many tokens a call, every position's logits, each equal bit "
        "for bit to what forward gives one token a call (attention row by row), on the same KV cache as forward "
        "(the methods share their mutable buffers). What speculative decoding verifies drafts with "
        "(optimize run --speculative): a draft of verify_tokens - 1 tokens at most. null (default): not "
        "exported. Costs a second lowering at export time and, once loaded, a second copy of XNNPACK's packed "
        "weights in memory",
    )
    draft_vocab: int | None = Field(
        None,
        ge=2,
        description="with the pipeline's draft block: the draft's head covers only this many tokens (the run's "
        "text's most frequent, the special tokens, then the lowest ids), so a draft token reads that many rows "
        "of the head instead of the whole vocabulary's; its map is the constant method get_draft_vocab. A token "
        "outside it is never drafted (output unchanged, only acceptance pays). null: the draft's whole head, "
        "stored once when it is the target's",
    )
    fuse_projections: bool = Field(
        True,
        description="run q/k/v and gate/up, which read the same input, as one GEMM each (their weights "
        "concatenated, quantized weights bit-for-bit; a group whose schemes differ stays apart): 3 fewer "
        "XNNPACK ops a layer for every token",
    )
    split_layers: bool = Field(
        True,
        description="keep each decoder layer's residual adds outside XNNPACK, so a layer lowers into "
        "three small delegates instead of one large one: the threadpool's worker then keeps spinning "
        "between them instead of sleeping once a layer (SmolLM2 8da4w, 2 threads: decode 5.9% faster, "
        "prefill-128 7% slower)",
    )
    tokenizer_type: int | None = Field(
        None,
        ge=0,
        description="value of the tokenizer_type metadata method read by TorchChat's runner "
        "(2 = SentencePiece, 3 = tiktoken/BPE); null infers it from the tokenizer",
    )


    def for_run(self, cfg: Any, label: str) -> "ExecuTorchOptions":
        """``scoring_method``'s null resolved for a pipeline run: on exactly when ``checks.tasks`` scores
        the export row (``label``) and ``forward`` returns only the last position; true/false stand."""
        if self.scoring_method is not None:
            return self
        tasks = cfg.checks.tasks
        wanted = tasks.enabled and tasks.selects(len(cfg.stages), label, label) and self.logits == "last"
        return self.model_copy(update={"scoring_method": wanted})

    @model_validator(mode="after")
    def _attention_with_quantize(self) -> "ExecuTorchOptions":
        if self.attention != "same" and self.quantize == "none":
            raise ValueError(f"attention: {self.attention} sets the attention projections' precision within the "
                             "exporter's quantization; with quantize: none the model is exported as given (set "
                             "quantize, or leave attention: same)")
        return self

    @model_validator(mode="after")
    def _scoring_beside_last(self) -> "ExecuTorchOptions":
        if self.scoring_method and self.logits == "all":
            raise ValueError("scoring_method: true adds forward_all beside a forward that returns only the last "
                             "position; with logits: all, forward already returns every position (drop scoring_method)")
        return self

DEFAULT_MAX_SEQ_LEN = 512

#: transformers model types whose attention this exporter routes through ExecuTorch's LLM ops
#: (each covered by a test against eager)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "smollm3",
                         "gpt2", "opt", "gpt_neox", "mixtral")
#: why a family transformers builds cannot take the custom-op path (a more useful refusal than the list)
UNSUPPORTED_WHY = {
    model_type: "ALiBi attention (a per-head linear bias added to the attention scores, no rotary positions): "
                "ExecuTorch's llama::custom_sdpa adds no bias to the scores, so this exporter cannot run its "
                "attention; the onnxruntime target exports it"
    for model_type in ("bloom", "mpt")
}


def model_problems(config: Any, opts: ExecuTorchOptions) -> list[str]:
    """What the model's config shows this exporter cannot do with ``opts`` (one sentence each)."""
    from export.executorch.llm import plan_layers

    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    problems: list[str] = []
    model_type = getattr(cfg, "model_type", None)
    if model_type in UNSUPPORTED_WHY:
        return [f"model type {model_type!r} uses {UNSUPPORTED_WHY[model_type]}"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(
            f"model type {model_type!r} is not supported by the ExecuTorch exporter's custom-op attention and KV "
            f"cache (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
        return problems
    n = _resolve_max_seq_len(opts)
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and n > limit:
        problems.append(f"max_seq_len={n} exceeds the model's max_position_embeddings={limit}; "
                        f"export with max_seq_len <= {limit}")
    plan = plan_layers(config, n)
    problems.extend(plan.problems)
    if opts.verify_tokens and plan.windows:
        problems.append(f"verify_tokens: sliding-window layers (window {plan.windows[0]} < max_seq_len={n}) keep a "
                        "ring cache, which cannot be cut back after a rejected draft; export without verify_tokens, "
                        f"or with max_seq_len <= {plan.windows[0]}")
    if opts.verify_tokens and plan.softcap is not None:
        problems.append("verify_tokens: this model soft-caps its attention logits, which the exporter runs in plain ops "
                        "over a whole call, not row by row as verify needs to match one-token calls bit for bit; "
                        "export without verify_tokens")
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    if opts.quantize == "8da4w" and hidden:
        why = group_size_error(opts.group_size)
        if why is None:
            heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
            head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads else hidden)
            widths = {"q/k/v/gate/up projections": hidden,
                      "o_proj": heads * head_dim if heads else hidden,
                      "down_proj": int(getattr(cfg, "intermediate_size", hidden) or hidden)}
            if opts.lm_head == "same":
                widths["lm_head"] = hidden
            why = widths_error(opts.group_size, widths)
        if why:
            problems.append(why)
    if opts.embedding_quantize == "int4" and hidden:
        why = embedding_width_error(opts.embedding_group_size, hidden)
        if why:
            problems.append(why)
    return problems


def _resolve_max_seq_len(opts: ExecuTorchOptions) -> int:
    """The cache length: the options' (the pipeline fills it from the target profile), else 512."""
    return opts.max_seq_len if opts.max_seq_len is not None else DEFAULT_MAX_SEQ_LEN
