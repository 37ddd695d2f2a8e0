"""Post-training int8 quantization with torchao: ``8da8w`` and ``8da4w`` for ExecuTorch/XNNPACK.

Both schemes quantize activations dynamically (per token, asymmetric int8, computed at run
time) and weights statically (symmetric, ``8da8w``: int8 per output channel; ``8da4w``: int4
in groups along the input dimension). Nothing depends on data, so the stage needs no
calibration text. These are the torchao layouts (``IntxUnpackedToInt8Tensor``) that
ExecuTorch's XNNPACK partitioner recognises after ``torch.export``; int8 *weight-only* Linear
is deliberately not offered (it lowers to wrong logits on XNNPACK, see the target profile).

Why ``keep_high_precision`` defaults to ``["lm_head"]``: on SmolLM2-135M (tied embeddings)
the output projection is the most sensitive matmul, and keeping it fp32 costs no extra
bytes because it shares its weight with the fp32 embedding table; quantizing it un-ties
the pair and *adds* an int8/int4 copy. The price is decode bandwidth on a device (the fp32
head is read for every token); set ``keep_high_precision: []`` when that matters more. See
bench/ptq.py for the measured figures. Reference perplexity (4096 pydoc targets), fp32 14.71:
8da8w with lm_head fp32 14.88 (+1.2%), all int8 14.99 (+1.9%, bench/ptq.py; the shared notes
said 15.1): the default leaves margin under a 2% gate and is smaller. hqq_scale_only
scales made 8da8w worse (15.00) but 8da4w g32 (lm_head fp32) better (21.20 -> 20.74).

``quantize_embedding`` (torchao weight-only ``IntxWeightOnlyConfig`` on the ``nn.Embedding``)
runs in eager and exports, but is not an XNNPACK op: ExecuTorch lowers it only with
``to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))``, which fuses it
into ``quantized_decomposed::embedding_byte``/``embedding_4bit``, and the ``.pte`` then loads
only after ``import executorch.kernels.quantized`` (int8 checked on executorch 1.5.1 with a tiny
Llama; the int4 path was not run to a .pte).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from optimize.stage_api import StageConfig, StageContext, register_stage
from optimize.stages._ptq_gptq import GptqOptions, quantize_gptq
from optimize.stages._ptq_plan import DEFAULT_EMBEDDING_GROUP_SIZE, DEFAULT_GROUP_SIZE, budget_plan, plan, untie_config
from optimize.stages._select import is_tied
from targets.group_size import GROUP_MULTIPLE, embedding_group_size_error, group_size_error

class Ptq8Config(StageConfig):
    kind: Literal["ptq_int8"] = "ptq_int8"
    scheme: Literal["8da8w", "8da4w"] = Field(
        "8da8w",
        description="8da8w: dynamic int8 activations, int8 per-channel weights (near-lossless); "
        "8da4w: dynamic int8 activations, int4 group-wise weights (smaller, lossier)",
    )
    group_size: int | None = Field(
        None,
        gt=0,
        description=f"8da4w only: input channels per int4 weight group; a multiple of {GROUP_MULTIPLE} "
        f"(XNNPACK) that divides every quantized layer's in_features; default {DEFAULT_GROUP_SIZE}",
    )
    keep_high_precision: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="module-name fnmatch patterns (or the shorthands 'lm_head', 'embeddings') left in "
        "fp32; the default keeps the output projection, the most sensitive layer",
    )
    quantize_embedding: Literal["int8", "int4", "tied"] | None = Field(
        None,
        description="also quantize the input embedding table weight-only (int8 per row, or int4 in "
        "groups of embedding_group_size); an ExecuTorch .pte then needs executorch.kernels.quantized. "
        "tied: a tied embedding reuses the quantized lm_head's integers and scales (no extra bytes; "
        "onnxruntime target, GatherBlockQuantized)",
    )
    embedding_group_size: int | None = Field(
        None,
        gt=0,
        description=f"quantize_embedding=int4 only: columns per group, even and dividing the hidden "
        f"size; default {DEFAULT_EMBEDDING_GROUP_SIZE}",
    )
    weight_qparams: Literal["affine", "hqq_scale_only"] = Field(
        "affine",
        description="how weight scales are chosen: affine (min/max, fast) or hqq_scale_only (HQQ-optimised "
        "scales, as ExecuTorch's LLM export uses; helped 8da4w, hurt 8da8w on SmolLM2; ~3x slower to quantize)",
    )
    algorithm: Literal["rtn", "gptq"] = Field(
        "rtn",
        description="how weights are rounded: rtn (round-to-nearest, no data) or gptq (error feedback "
        "against calibration activations; same layout, lowers to XNNPACK unchanged)",
    )
    gptq: GptqOptions | None = Field(None, description="algorithm gptq only: GPTQ settings (defaults if omitted)")
    int8_modules: list[str] = Field(
        default_factory=list,
        description="8da4w only: module patterns (or 'lm_head') quantized 8da8w instead of int4: mixed "
        "precision listed by hand (e.g. ['lm_head', 'model.layers.0', '*.down_proj'])",
    )
    size_budget_mb: float | None = Field(
        None,
        gt=0,
        description="mixed precision by budget: promote the most sensitive candidate groups (scored by "
        "fake-quant KL on calibration text) to budget_promote_to while the estimated weight size stays "
        "within this many MB",
    )
    max_decode_slowdown_pct: float | None = Field(
        None,
        ge=0,
        le=1000,
        description="mixed precision by latency budget: promote sensitive groups while the estimated decode "
        "time (weight bytes read per token) stays within this many percent of every Linear, lm_head "
        "included, at the stage's scheme",
    )
    budget_promote_to: Literal["fp32", "8da8w"] | None = Field(
        None,
        description="precision a budget promotes groups to: 8da8w (default for 8da4w) or fp32 (default, and "
        "the only choice, for 8da8w)",
    )
    budget_candidates: list[str] | None = Field(
        None,
        min_length=1,
        description="size_budget_mb only: module patterns, each one candidate group (e.g. 'model.layers.0', "
        "'*.down_proj'); default every block, every projection type and lm_head",
    )
    budget_windows: int | None = Field(
        None, ge=1, le=64, description="size_budget_mb / max_decode_slowdown_pct only: calibration windows the "
        "sensitivity scoring runs (default 2)"
    )
    modules: list[str] | None = Field(
        None,
        min_length=1,
        description="fnmatch patterns restricting which nn.Linear layers are quantized (default: all, "
        "minus keep_high_precision); for mixed precision",
    )

    @field_validator("group_size")
    @classmethod
    def _group_multiple(cls, v: int | None) -> int | None:
        why = group_size_error(v) if v is not None else None
        if why:
            raise ValueError(why)
        return v

    @field_validator("embedding_group_size")
    @classmethod
    def _even(cls, v: int | None) -> int | None:
        why = embedding_group_size_error(v) if v is not None else None
        if why:
            raise ValueError(why)
        return v

    @field_validator("keep_high_precision", "modules", "int8_modules")
    @classmethod
    def _patterns(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            bad = [p for p in v if not isinstance(p, str) or not p.strip()]
            if bad:
                raise ValueError(f"module patterns must be non-empty strings, got {bad!r}")
        return v

    @model_validator(mode="after")
    def _scheme_options(self) -> "Ptq8Config":
        if self.scheme == "8da8w" and self.group_size is not None:
            raise ValueError(
                "group_size applies only to scheme 8da4w; 8da8w quantizes weights per output channel"
            )
        if self.quantize_embedding != "int4" and self.embedding_group_size is not None:
            raise ValueError("embedding_group_size applies only to quantize_embedding: int4")
        budget = self.size_budget_mb is not None or self.max_decode_slowdown_pct is not None
        if not budget:
            for opt in ("budget_candidates", "budget_promote_to", "budget_windows"):
                if getattr(self, opt) is not None:
                    raise ValueError(f"{opt} applies only with size_budget_mb or max_decode_slowdown_pct")
        if self.scheme == "8da8w" and self.budget_promote_to == "8da8w":
            raise ValueError("budget_promote_to: 8da8w needs scheme 8da4w (the layers already are 8da8w); use fp32")
        if self.scheme == "8da8w" and self.int8_modules:
            raise ValueError("int8_modules applies only to scheme 8da4w (8da8w quantizes every layer to int8)")
        if self.gptq is not None and self.algorithm != "gptq":
            raise ValueError("gptq options apply only with algorithm: gptq")
        if self.algorithm == "gptq" and self.weight_qparams != "affine":
            raise ValueError(
                "algorithm gptq chooses its own scales: drop weight_qparams (use gptq.scale_init: hqq for HQQ scales)"
            )
        if self.quantize_embedding == "tied" and "lm_head" in self.keep_high_precision:
            raise ValueError("quantize_embedding: tied shares the quantized lm_head with the embedding; "
                             "drop 'lm_head' from keep_high_precision")
        if self.quantize_embedding and "embeddings" in self.keep_high_precision:
            raise ValueError(
                "quantize_embedding conflicts with keep_high_precision containing 'embeddings'; drop one"
            )
        return self

    def quant_scheme(self) -> str:
        return self.scheme

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        """The layer selection and group sizes against the model's layers (:func:`plan` on a
        weightless copy), so a pattern typo or a group size that does not divide a layer's
        in_features is refused at validation, not after the earlier stages ran."""
        from optimize.stages._preflight import with_meta_model

        def check(model: nn.Module) -> list[str]:
            try:
                plan(model, self)
            except ValueError as exc:
                return [str(exc).removeprefix("ptq_int8: ")]
            return []

        if self.quantize_embedding == "tied" and target is not None and getattr(target, "exporter", None) != "onnxruntime":
            return [f"quantize_embedding: tied is read by the onnxruntime target only (GatherBlockQuantized); "
                    f"target {target.name!r} needs int8 or int4"]
        return with_meta_model(config, check)

    @property
    def promote_to(self) -> str:
        """What a budget promotes sensitive groups to."""
        return self.budget_promote_to or ("8da8w" if self.scheme == "8da4w" else "fp32")

    @property
    def effective_group_size(self) -> int | None:
        """Group size the 8da4w weights use, or None for per-channel 8da8w."""
        if self.scheme == "8da4w":
            return self.group_size or DEFAULT_GROUP_SIZE
        return None


def linear_config(cfg: Ptq8Config):
    """The torchao config for the chosen scheme (the layout ExecuTorch's XNNPACK lowers)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    algo = dict(intx_choose_qparams_algorithm=cfg.weight_qparams)
    if cfg.scheme == "8da8w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0), **algo)
    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(cfg.effective_group_size), **algo
    )


def embedding_config(cfg: Ptq8Config):
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if cfg.quantize_embedding == "int8":
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    return IntxWeightOnlyConfig(
        weight_dtype=torch.int4, granularity=PerGroup(cfg.embedding_group_size or DEFAULT_EMBEDDING_GROUP_SIZE)
    )


@register_stage("ptq_int8", Ptq8Config)
def ptq_int8(model: nn.Module, cfg: Ptq8Config, ctx: StageContext) -> nn.Module:
    """Quantize nn.Linear layers with torchao: 8da8w (int8 per-channel) or 8da4w (int4 groups), round-to-nearest or GPTQ, mixed precision by hand or by budget."""
    from torchao.quantization import quantize_

    p = plan(model, cfg)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    was_tied = is_tied(in_emb, out_emb)

    budget = None
    if cfg.size_budget_mb is not None or cfg.max_decode_slowdown_pct is not None:
        budget = budget_plan(model, cfg, ctx, p)
    eight = [n for n in p["selected"] if n in set(p["int8"])] if cfg.scheme == "8da4w" else []
    four = [n for n in p["selected"] if n not in set(eight)]
    gptq = None
    if cfg.algorithm == "gptq":
        gptq = quantize_gptq(model, cfg, ctx, four, eight)
    else:
        sel4 = set(four)
        quantize_(model, linear_config(cfg), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in sel4)
        if eight:
            sel8 = set(eight)
            quantize_(model, linear_config(cfg.model_copy(update={"scheme": "8da8w", "group_size": None})),
                      filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in sel8)
    if p["embedding"] is not None:
        emb_fqn = p["embedding"]
        quantize_(model, embedding_config(cfg), filter_fn=lambda m, fqn: fqn == emb_fqn)

    if cfg.quantize_embedding == "tied":  # the embedding looks up the lm_head's quantized rows
        if type(out_emb.weight) in (torch.Tensor, nn.Parameter):
            raise ValueError("ptq_int8: quantize_embedding: tied, but the lm_head was left fp32 (by the size budget?)")
        in_emb.weight = out_emb.weight
    untied = was_tied and not is_tied(in_emb, out_emb)
    if untied:
        untie_config(model)
    ctx.details.update(
        {
            "scheme": cfg.scheme,
            "group_size": cfg.effective_group_size,
            "weight_bits": 8 if cfg.scheme == "8da8w" else 4,
            "algorithm": cfg.algorithm,
            "weight_qparams": cfg.weight_qparams,
            "activations": "int8 dynamic per-token (no calibration)",
            "linear_quantized": len(p["selected"]),
            "linear_kept": len(p["kept"]),
            "kept_modules": p["kept"],
            "int8_modules": eight,
            "precision_mix": {"fp32": len(p["kept"]), "8da8w": len(eight) if cfg.scheme == "8da4w" else len(four),
                              "8da4w": len(four) if cfg.scheme == "8da4w" else 0},
            "embedding_quantized": cfg.quantize_embedding,
            "untied_embeddings": untied,
        }
    )
    if gptq is not None:
        ctx.details["gptq"] = gptq
    if budget is not None:
        ctx.details["mixed_precision"] = budget
    if p["conv1d_skipped"]:
        ctx.details["conv1d_kept_fp32"] = p["conv1d_skipped"]
    ctx.log(
        f"ptq_int8 {cfg.scheme} ({cfg.algorithm}): quantized {len(p['selected'])} Linear layers"
        + (f" ({len(eight)} at 8da8w)" if eight else "")
        + f", kept {len(p['kept'])} in fp32"
        + (f" ({', '.join(p['kept'][:4])}{'...' if len(p['kept']) > 4 else ''})" if p["kept"] else "")
        + (f"; embedding {cfg.quantize_embedding}" if cfg.quantize_embedding else "")
    )
    return model
