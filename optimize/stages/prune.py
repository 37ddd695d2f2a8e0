"""``prune``: remove what calibration text shows the model needs least.

- ``depth``: drop whole decoder blocks, ranked by ShortGPT's Block Influence (``1 - cos`` of
  a block's input and output) or by the calibration-loss rise when the block is skipped.
- ``width``: remove attention heads (whole KV groups and/or the same number of query heads in
  every group, so GQA stays valid) and MLP channels, ranked by Minitron's activation-based
  importance. Depth and width give a smaller dense model with an updated transformers config
  that saves, reloads with ``from_pretrained`` and exports like the original: fewer weight bytes
  read per token, so a weight-bound runtime (decode on XNNPACK) runs faster.
- ``unstructured`` (``sparsity`` per output row) and ``semi_structured`` (2:4), scored by
  magnitude or Wanda (``|W| * ||X||``): zeros in place. Neither ExecuTorch/XNNPACK nor ONNX
  Runtime's CPU provider has kernels that skip them, so neither size nor speed changes there;
  they are a starting point for sparse-aware runtimes (2:4 on NVIDIA GPUs), stated in the report.

What was removed is recorded in ``model.config.pruning`` (saved with the model), so a later
``distill`` stage can match the student's blocks to the teacher's and keep zeros at zero.
A distillation stage (teacher: the model as it entered the pipeline) usually follows.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from torch import nn

from optimize.module_select import select_modules, unmatched_patterns
from optimize.prune import importance as imp
from optimize.prune.arch import decoder_layers, family_of, family_problem, shape
from optimize.prune.select import keep_blocks, keep_channels, keep_heads, kept_mlp_width
from optimize.prune.sparsity import apply_mask, n_of_m_mask, row_mask, score
from optimize.prune.structured import PruneError, check_plain, drop_blocks, slice_width
from optimize.stage_api import StageConfig, StageContext, register_stage

_FIELDS = {
    "depth": {"num_hidden_layers", "block_score"},
    "width": {"num_attention_heads", "num_key_value_heads", "mlp_ratio", "channel_multiple", "hidden_size"},
    "unstructured": {"sparsity", "score", "modules"},
    "semi_structured": {"score", "modules"},
}
NO_SPARSE_GAIN = (
    "no size or speed gain on ExecuTorch/XNNPACK or ONNX Runtime CPU: both store the zeros densely and "
    "multiply them (XNNPACK's sparse kernels cover NCHW convolutions, not transformer Linear layers); "
    "2:4 pays off only on runtimes with sparse kernels (e.g. NVIDIA sparse tensor cores)"
)


class PruneConfig(StageConfig):
    kind: Literal["prune"] = "prune"
    method: Literal["depth", "width", "unstructured", "semi_structured"] = Field(
        ..., description="depth: drop decoder blocks; width: heads and MLP channels; unstructured: zeros by "
        "row; semi_structured: 2:4 zeros (the last two keep shapes and, on CPU runtimes, speed)"
    )
    num_hidden_layers: int | None = Field(None, ge=1, description="depth: decoder blocks kept")
    block_score: Literal["block_influence", "loss"] | None = Field(
        None, description="depth: block_influence (ShortGPT, 1 - cos(in, out); default) or loss (calibration "
        "loss rise when the block is skipped; one pass per block)"
    )
    num_attention_heads: int | None = Field(
        None, ge=1, description="width: query heads kept; a multiple of the KV heads kept (the same in every group)"
    )
    num_key_value_heads: int | None = Field(
        None, ge=1, description="width: KV heads (GQA groups) kept, whole groups with their query heads"
    )
    mlp_ratio: float | None = Field(None, description="width: fraction of MLP channels removed, in [0, 1)")
    hidden_size: int | None = Field(
        None, ge=1, description="width: residual-stream (embedding) channels kept, ranked by mean |norm output| "
        "(Minitron); every projection, norm, the embedding and the head shrink with it"
    )
    channel_multiple: int | None = Field(
        None, ge=1, description="width: round the MLP channels kept down to a multiple of this (default 32, "
        "so 8da4w's group size divides down_proj)"
    )
    sparsity: float | None = Field(None, description="unstructured: fraction of weights zeroed in each row, in (0, 1)")
    score: Literal["magnitude", "wanda"] | None = Field(
        None, description="unstructured/semi_structured: |W| (magnitude) or |W|*||X|| (wanda, default)"
    )
    modules: list[str] | None = Field(
        None, min_length=1, description="unstructured/semi_structured: fnmatch patterns of the nn.Linear layers "
        "pruned (default: every Linear except lm_head)"
    )
    calibration_windows: int | None = Field(
        None, ge=1, description="calibration windows scored (default: all of ctx.calibration)"
    )

    @field_validator("mlp_ratio")
    @classmethod
    def _ratio(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v < 1:
            raise ValueError(f"mlp_ratio={v} is out of range: the fraction of MLP channels removed must be in [0, 1)")
        return v

    @field_validator("sparsity")
    @classmethod
    def _sparsity(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v < 1:
            raise ValueError(f"sparsity={v} is out of range: the fraction of weights zeroed must be in (0, 1)")
        return v

    @model_validator(mode="after")
    def _method_fields(self) -> "PruneConfig":
        given = {f for f in set().union(*_FIELDS.values()) if getattr(self, f) is not None}
        stray = sorted(given - _FIELDS[self.method])
        if stray:
            raise ValueError(f"{', '.join(stray)} do(es) not apply to method {self.method!r}; its options: "
                             f"{', '.join(sorted(_FIELDS[self.method]))}")
        if self.method == "depth" and self.num_hidden_layers is None:
            raise ValueError("method depth needs num_hidden_layers (decoder blocks kept)")
        if self.method == "width" and given.isdisjoint({"num_attention_heads", "num_key_value_heads", "mlp_ratio",
                                                        "hidden_size"}):
            raise ValueError("method width needs num_attention_heads, num_key_value_heads, mlp_ratio and/or hidden_size")
        if self.method == "unstructured" and self.sparsity is None:
            raise ValueError("method unstructured needs sparsity (fraction of weights zeroed per row)")
        return self

    # ---- targets, resolved against a config
    def _heads(self, s: dict) -> tuple[int, int]:
        kv = self.num_key_value_heads or s["kv_heads"]
        heads = self.num_attention_heads or kv * (s["heads"] // s["kv_heads"])
        return heads, kv

    def _mlp(self, s: dict) -> int:
        if self.mlp_ratio is None:
            return s["intermediate"]
        return kept_mlp_width(s["intermediate"], self.mlp_ratio, self.channel_multiple or 32)

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        if self.method not in ("depth", "width"):
            return []
        why = family_problem(config, self.method)
        if why:
            return [why]
        s = shape(config)
        if self.method == "depth":
            if self.num_hidden_layers >= s["layers"]:
                return [f"num_hidden_layers={self.num_hidden_layers} keeps every one of the model's {s['layers']} "
                        f"blocks; choose 1..{s['layers'] - 1}"]
            return []
        problems = []
        heads, kv = self._heads(s)
        group = s["heads"] // s["kv_heads"]
        if kv > s["kv_heads"]:
            problems.append(f"num_key_value_heads={kv} exceeds the model's {s['kv_heads']}; pruning only removes heads")
        elif heads > s["heads"]:
            problems.append(f"num_attention_heads={heads} exceeds the model's {s['heads']}")
        elif heads % kv:
            ok = ", ".join(str(kv * g) for g in range(1, group + 1))
            problems.append(f"num_attention_heads={heads} breaks GQA: it must be a multiple of the {kv} KV heads "
                            f"kept (the same query heads in every group): {ok}")
        elif heads // kv > group:
            problems.append(f"num_attention_heads={heads} over {kv} KV heads needs {heads // kv} query heads per "
                            f"group, but each group has {group}; keep at most {kv * group}")
        fam = family_of(config)
        hidden = self.hidden_size or s["hidden"]
        if self.hidden_size is not None and not fam.hidden_prunable:
            problems.append(f"hidden_size pruning is not supported for {config.model_type}: its embeddings are scaled "
                            "by sqrt(hidden_size) and tied to the output head; prune heads, MLP channels or depth")
        elif hidden > s["hidden"]:
            problems.append(f"hidden_size={hidden} exceeds the model's {s['hidden']}; pruning only removes channels")
        if not problems and fam.heads_divide_hidden and hidden % heads:
            ok = [kv * g for g in range(1, group + 1) if hidden % (kv * g) == 0]
            problems.append(f"num_attention_heads={heads} does not divide hidden_size={hidden}, which "
                            f"transformers' {config.model_type} config requires (even with head_dim explicit); "
                            f"counts that work with {kv} KV heads: {ok or 'none'}")
        if (heads, kv) != (s["heads"], s["kv_heads"]) and config.model_type == "phi3":
            rope = getattr(config, "rope_parameters", None) or {}
            if rope.get("rope_type") == "longrope":
                problems.append("head pruning of a Phi-3 longrope model is not supported: its config derives the "
                                "rotary size from hidden_size / num_attention_heads; prune MLP channels or depth")
        if self.mlp_ratio is not None:
            m = self.channel_multiple or 32
            if self._mlp(s) < max(m, 1):
                problems.append(f"mlp_ratio={self.mlp_ratio} leaves {int(s['intermediate'] * (1 - self.mlp_ratio))} "
                                f"of {s['intermediate']} MLP channels, under one channel_multiple ({m})")
        return problems

    def planned_config(self, config: Any) -> Any:
        if self.method not in ("depth", "width") or family_problem(config, self.method):
            return config
        new = copy.deepcopy(config)
        s = shape(config)
        if self.method == "depth":
            new.num_hidden_layers = min(self.num_hidden_layers, s["layers"])
            for attr in ("layer_types",):  # which blocks go is known only after scoring; the length is
                values = getattr(new, attr, None)
                if isinstance(values, list):
                    setattr(new, attr, values[: new.num_hidden_layers])
            return new
        new.head_dim = s["head_dim"]
        new.num_attention_heads, new.num_key_value_heads = self._heads(s)
        new.intermediate_size = self._mlp(s)
        new.hidden_size = self.hidden_size or s["hidden"]
        return new


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _weight_mb(model: nn.Module) -> float:
    seen = {id(p): p for p in model.parameters()}
    return round(sum(p.numel() * p.element_size() for p in seen.values()) / 2**20, 3)


def _windows(cfg: PruneConfig, ctx: StageContext, needed: bool) -> list:
    windows = list(ctx.calibration[: cfg.calibration_windows] if cfg.calibration_windows else ctx.calibration)
    if needed and not windows:
        raise PruneError(f"prune: method {cfg.method} scores importance on calibration text, but "
                         "ctx.calibration is empty; set data.calibration_tokens")
    return windows


def _record(model: nn.Module, entry: dict) -> None:
    """Append to ``config.pruning`` (saved in config.json) what this stage removed."""
    history = list(getattr(model.config, "pruning", None) or [])
    model.config.pruning = history + [entry]


def _depth(model: nn.Module, cfg: PruneConfig, ctx: StageContext, windows: list) -> tuple[nn.Module, dict]:
    n = len(decoder_layers(model))
    kind = cfg.block_score or "block_influence"
    if kind == "loss":
        scores = imp.block_loss_increase(model, windows)
    else:
        scores = imp.block_influence(model, windows)
    keep = keep_blocks(scores, cfg.num_hidden_layers)
    removed = [i for i in range(n) if i not in keep]
    new = drop_blocks(model, keep)
    _record(new, {"method": "depth", "kept_layers": keep, "num_hidden_layers_before": n})
    ctx.log(f"prune depth: removed blocks {removed} of {n} by {kind}")
    return new, {"block_score": kind, "scores": [round(x, 6) for x in scores], "removed_blocks": removed,
                 "kept_blocks": keep, "num_hidden_layers": [n, len(keep)]}


def _width(model: nn.Module, cfg: PruneConfig, ctx: StageContext, windows: list) -> tuple[nn.Module, dict]:
    s = shape(model.config)
    heads, kv = cfg._heads(s)
    width = cfg._mlp(s)
    head_imp, chan_imp = imp.width_importance(model, windows)
    hidden = cfg.hidden_size or s["hidden"]
    kept_hidden = None
    if hidden != s["hidden"]:
        kept_hidden = keep_channels(imp.hidden_importance(model, windows), hidden)
    kept_h, kept_kv, kept_c = [], [], []
    for i in range(s["layers"]):
        h, g = keep_heads(head_imp[i], s["kv_heads"], kv, heads // kv)
        kept_h.append(h)
        kept_kv.append(g)
        kept_c.append(keep_channels(chan_imp[i], width))
    new = slice_width(model, kept_h, kept_kv, kept_c, kept_hidden)
    record = {"method": "width", "num_attention_heads": [s["heads"], heads],
              "num_key_value_heads": [s["kv_heads"], kv], "intermediate_size": [s["intermediate"], width],
              "hidden_size": [s["hidden"], hidden], "kept_heads": kept_h, "kept_kv_heads": kept_kv}
    if kept_hidden is not None:  # lets distillation start its student->teacher projection as the identity on them
        record["kept_hidden"] = kept_hidden.tolist()
    _record(new, record)
    ctx.log(f"prune width: heads {s['heads']}->{heads}, KV heads {s['kv_heads']}->{kv}, "
            f"MLP {s['intermediate']}->{width} per block, hidden {s['hidden']}->{hidden}")
    removed_mass = float(sum(chan_imp[i].sum() - chan_imp[i][c].sum() for i, c in enumerate(kept_c)))
    return new, {"num_attention_heads": [s["heads"], heads], "num_key_value_heads": [s["kv_heads"], kv],
                 "intermediate_size": [s["intermediate"], width], "hidden_size": [s["hidden"], hidden],
                 "head_dim": s["head_dim"],
                 "kept_heads": kept_h, "kept_kv_heads": kept_kv,
                 "mlp_importance_removed_fraction": round(removed_mass / max(float(chan_imp.sum()), 1e-30), 6)}


def _sparse(model: nn.Module, cfg: PruneConfig, ctx: StageContext, windows: list) -> tuple[nn.Module, dict]:
    typos = unmatched_patterns(model, cfg.modules or [])
    if typos:
        raise PruneError(f"prune: pattern(s) {typos} match no module of {type(model).__name__}")
    names, _ = select_modules(model, nn.Linear, include=cfg.modules, exclude=["lm_head"])
    if not names:
        raise PruneError("prune: no nn.Linear layer matches `modules` (lm_head is never pruned)")
    check_plain(model)
    mods = dict(model.named_modules())
    kind = cfg.score or "wanda"
    norms = imp.input_norms(model, names, windows) if kind == "wanda" else {}
    zeros = total = 0
    for name in names:
        w = mods[name].weight
        sc = score(w, norms.get(name))
        mask = n_of_m_mask(sc, 2, 4) if cfg.method == "semi_structured" else row_mask(sc, cfg.sparsity)
        zeros += apply_mask(w.data, mask)
        total += w.numel()
    pattern = "2:4" if cfg.method == "semi_structured" else f"{cfg.sparsity:.0%} per row"
    _record(model, {"method": cfg.method, "pattern": pattern, "modules": names})
    ctx.log(f"prune {pattern} ({kind}): {len(names)} Linear layers, {zeros / total:.1%} of their weights zero; "
            "no size or speed gain on CPU runtimes")
    return model, {"pattern": pattern, "score": kind, "modules_pruned": len(names),
                   "sparsity_achieved": round(zeros / total, 6), "runtime_gain": NO_SPARSE_GAIN}


@register_stage("prune", PruneConfig)
def prune(model: nn.Module, cfg: PruneConfig, ctx: StageContext) -> nn.Module:
    """Prune on calibration text: depth (blocks) or width (GQA heads, MLP channels) -> a smaller, faster dense model; unstructured/2:4 zeros give no size or speed gain on XNNPACK or ORT CPU."""
    if cfg.method in ("depth", "width"):
        problems = cfg.check_model(model.config, None)
        if problems:
            raise PruneError("prune: " + "; ".join(problems))
    needs_data = cfg.method in ("depth", "width") or (cfg.score or "wanda") == "wanda"
    windows = _windows(cfg, ctx, needs_data)
    before = {"params": _params(model), "weight_mb": _weight_mb(model)}
    was_training = model.training
    model.eval()
    if cfg.method == "depth":
        model, facts = _depth(model, cfg, ctx, windows)
    elif cfg.method == "width":
        model, facts = _width(model, cfg, ctx, windows)
    else:
        model, facts = _sparse(model, cfg, ctx, windows)
    model.train(was_training)
    after = {"params": _params(model), "weight_mb": _weight_mb(model)}
    ctx.details.update({"method": cfg.method, "calibration_tokens": sum(int(w.numel()) for w in windows),
                        "params": [before["params"], after["params"]],
                        "weight_mb": [before["weight_mb"], after["weight_mb"]], **facts})
    return model
