"""The ``ptq_int8`` stage's typed config: :class:`Ptq8Config` and its GPTQ settings.

Why a module of its own: the stage (:mod:`optimize.stages.ptq_int8`), its GPTQ glue
(:mod:`optimize.stages.ptq_gptq`) and the QAT stage, which trains for exactly what ptq_int8
would ship, all read this config, so it must not import any of them: the modules then form a
line (selection rules <- config <- GPTQ glue <- stage) instead of a circle. The rules it checks
a model against (:mod:`optimize.stages.ptq_plan`) take plain values and know nothing of this
class. Why the defaults are what they are: see the stage's docstring.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from torch import nn

from optimize.quant.host_independent import DESCRIPTION as CALIBRATION_DTYPE, CalibrationDtype
from optimize.stage_api import StageConfig
from optimize.stages._preflight import with_meta_model
from optimize.stages.ptq_plan import LayerPlan, plan
from targets.config_base import Strict
from targets.group_size import GROUP_MULTIPLE, embedding_group_size_error, group_size_error

#: input channels per int4 weight group when ``group_size`` is not given
DEFAULT_GROUP_SIZE = 32
#: columns per group of an int4 embedding table when ``embedding_group_size`` is not given
DEFAULT_EMBEDDING_GROUP_SIZE = 32


class GptqOptions(Strict):
    """GPTQ settings (``algorithm: gptq``); see :mod:`optimize.quant.gptq`."""

    scale_init: Literal["mse", "absmax", "hqq", "output_mse"] = Field(
        "mse",
        description="how each group's scale is fixed before the error feedback: mse (clip search that "
        "minimises the group's rounding error; best on SmolLM2), absmax (torchao's max|w| rule), hqq, "
        "output_mse (clip search that minimises the output error on the calibration inputs: each input "
        "column's squared error weighted by the Hessian's diagonal, as AWQ's clip search)",
    )
    act_order: bool = Field(True, description="quantize the most-used input columns first (static groups keep XNNPACK's layout)")
    damp: Annotated[float, Field(gt=0, lt=1)] | Literal["auto"] = Field(
        0.01,
        description="fraction of the mean Hessian diagonal added for stability, in (0, 1); or auto: per layer, "
        "the fraction of 0.001, 0.003, 0.01, 0.03, 0.1 whose GPTQ output error on the undamped Hessian is "
        "lowest (skipping any that does not factorise; the stage's details count the choices)",
    )
    block_size: int = Field(128, ge=1, le=4096, description="columns updated together (speed only; same result)")
    calibration_dtype: CalibrationDtype = Field("auto", description=CALIBRATION_DTYPE)
    calibration_windows: int = Field(
        8, ge=1, le=256,
        description="at most this many calibration windows build the Hessians (needs data.calibration_tokens >= "
        "windows x seq_len); 8 is the default, the SmolLM2 demo recipe (examples/smollm2.yaml) uses 32 "
        "windows of 512 tokens: GPTQ's rounding follows the host's float paths and more windows steady it",
    )

    @field_validator("damp", mode="before")
    @classmethod
    def _damp(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip() != "auto":
            try:  # a number given as text (a key=value override) stays a number
                v = float(v)
            except ValueError:
                raise ValueError(f"damp must be a number in (0, 1) or 'auto', got {v!r}") from None
        elif isinstance(v, str):
            return "auto"
        if isinstance(v, bool):
            raise ValueError(f"damp must be a number in (0, 1) or 'auto', got {v!r}")
        if isinstance(v, (int, float)) and not 0 < v < 1:
            raise ValueError(f"damp must lie in (0, 1) (a fraction of the mean Hessian diagonal) or be 'auto', got {v}")
        return v


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
    source_grid: bool = Field(
        False,
        description="8da4w only: a Linear whose weights already lie on a 4-bit grid of group_size columns (a "
        "model converted from a GGUF Q4_0/Q4_1/Q4_K file) keeps that grid exactly instead of being rounded "
        "again: symmetric int4 with the grid's own step, plus a per-group offset path where the grid is not "
        "centred on zero (Q4_1, Q4_K); the other layers are quantized by `algorithm`. Exports to executorch and "
        "onnxruntime (fused graph: MatMulNBits plus the offset's group sums)",
    )
    source_grid_offset: Literal["fp32", "int8"] | None = Field(
        None,
        description="source_grid only: precision of the offset path's small Linear (in/group_size inputs): "
        "fp32 (the default: exact, 1/8 byte per weight) or int8 (8da8w per channel, 1/32 byte per weight; on "
        "SmolLM2 7% smaller, but slower: one more dynamic quantization per path)",
    )
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
        if self.source_grid and self.scheme != "8da4w":
            raise ValueError("source_grid applies only to scheme 8da4w (it keeps a 4-bit grid)")
        if not self.source_grid and self.source_grid_offset is not None:
            raise ValueError("source_grid_offset applies only with source_grid: true")
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
        def check(model: nn.Module) -> list[str]:
            try:
                self.layer_plan(model)
            except ValueError as exc:
                return [str(exc).removeprefix("ptq_int8: ")]
            return []

        exporter = getattr(target, "exporter", None) if target is not None else None
        if self.source_grid and exporter not in (None, "executorch", "onnxruntime"):
            return [f"source_grid adds offset paths that the executorch and onnxruntime targets export; target "
                    f"{target.name!r} re-quantizes the weights itself and needs source_grid: false"]
        if self.quantize_embedding == "tied" and target is not None and getattr(target, "exporter", None) != "onnxruntime":
            return [f"quantize_embedding: tied is read by the onnxruntime target only (GatherBlockQuantized); "
                    f"target {target.name!r} needs int8 or int4"]
        # as the stage does first: a mixture's experts are planned as the Linears they become
        return with_meta_model(config, check, split_experts=True)

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

    @property
    def effective_embedding_group_size(self) -> int:
        """Columns per group of an int4 embedding table."""
        return self.embedding_group_size or DEFAULT_EMBEDDING_GROUP_SIZE

    def layer_plan(self, model: nn.Module) -> LayerPlan:
        """Which of ``model``'s layers this config quantizes, and how (:func:`~optimize.stages.ptq_plan.plan`);
        raises ValueError naming the first rule the model breaks."""
        return plan(model, keep_high_precision=self.keep_high_precision, modules=self.modules,
                    int8_modules=self.int8_modules, group_size=self.effective_group_size,
                    quantize_embedding=self.quantize_embedding,
                    embedding_group_size=self.effective_embedding_group_size)
