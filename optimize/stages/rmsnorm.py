"""``rmsnorm``: replace LayerNorm by RMSNorm, exactly for pre-LN models.

Edge runtimes and TorchChat take RMSNorm only. For pre-LayerNorm transformers (GPT-2, OPT
with do_layer_norm_before, GPT-NeoX/Pythia parallel or not, Phi) the rewrite is exact: see
``optimize.rewrites.layernorm_fold``. Other models are refused with the reason, unless the
config sets ``approximate: true``, which swaps the norms anyway (weight = gamma, beta and
centring dropped) and may heal afterwards. The exact rewrite is proven on calibration windows
(``exactness``: logits before vs after, :mod:`optimize.rewrites.exactness`) and refused if
they moved; an architecture without an exact plan is refused at validation already.

Reload: the model stays its HF class with ``LlamaRMSNorm`` modules; the rewrite is recorded
in ``config.edge_optimize_rmsnorm``. Load a saved result with
``optimize.rewrites.layernorm_fold.load_rewritten(dir)`` (plain ``from_pretrained`` would
rebuild LayerNorms and drop biases the fold added).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Literal

from pydantic import Field, model_validator
from torch import nn

from optimize.finetune import FinetuneConfig, finetune
from optimize.rewrites.exactness import ExactnessConfig, ExactnessProbe, probe_windows
from optimize.rewrites.layernorm_fold import (
    CONFIG_KEY,
    apply_structure,
    fold_exact,
    planned_record,
    swap_approximate,
    untie_config,
)
from optimize.rewrites.ln_plans import RewriteRefused, plan_for
from optimize.stage_api import StageConfig, StageContext, register_stage
from optimize.stages._preflight import meta_or_none, with_meta_model


class RMSNormConfig(StageConfig):
    kind: Literal["rmsnorm"] = "rmsnorm"
    approximate: bool = Field(
        False,
        description="if the exact rewrite does not apply (post-LN, unknown architecture), swap every LayerNorm "
        "for RMSNorm anyway (weight = gamma, beta dropped); changes the model, so heal it",
    )
    heal: FinetuneConfig | None = Field(
        None, description="short distillation/fine-tune after an approximate swap (needs approximate: true)"
    )
    exactness: ExactnessConfig = Field(
        default_factory=ExactnessConfig,
        description="how the exact rewrite is proven: logits before vs after on calibration windows; the "
        "stage refuses a model whose logits move more than the tolerance (not used by approximate swaps)",
    )

    @model_validator(mode="after")
    def _heal_needs_approximate(self):
        if self.heal is not None and not self.approximate:
            raise ValueError("heal needs approximate: true (the exact rewrite changes no outputs, so it needs no healing)")
        return self

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        if self.approximate:
            return []

        def check(model: nn.Module) -> list[str]:
            if not any(isinstance(m, nn.LayerNorm) for m in model.modules()):
                return []  # nothing to rewrite: the stage is a no-op
            try:
                plan_for(model)
            except RewriteRefused as exc:
                return [f"exact rewrite refused: {exc}"]
            return []

        return with_meta_model(config, check)

    def planned_config(self, config: Any) -> Any:
        """Record the rewrite the way the stage will (``config.edge_optimize_rmsnorm``, marked
        ``planned``), so exporters that need RMSNorm (TorchChat) see it at validation."""
        model = meta_or_none(config)
        record = planned_record(model, self.approximate) if model is not None else None
        if record is None:
            return config
        config = copy.deepcopy(config)
        setattr(config, CONFIG_KEY, record)
        if record["untied_head"]:
            untie_config(config)
        return config


def restore(model: nn.Module, cfg: RMSNormConfig | None = None) -> None:
    """Re-apply the rewrite's module layout to a model rebuilt from its saved config (checkpoint
    resume): the record in ``config.edge_optimize_rmsnorm`` says which norms and biases."""
    record = getattr(model.config, CONFIG_KEY, None)
    if record is not None:
        apply_structure(model, record)


@register_stage("rmsnorm", RMSNormConfig, restore=restore)
def rmsnorm(model: nn.Module, cfg: RMSNormConfig, ctx: StageContext) -> nn.Module:
    """LayerNorm -> RMSNorm: exact fold for pre-LN GPT-2/OPT/GPT-NeoX/Phi, optional approximate swap + heal."""
    layernorms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    if not layernorms:
        ctx.details.update({"mode": "none", "reason": "model has no LayerNorm modules"})
        ctx.log("rmsnorm: model has no LayerNorm modules; nothing to do")
        return model
    try:
        plan = plan_for(model)
    except RewriteRefused as exc:
        if not cfg.approximate:
            raise RewriteRefused(f"rmsnorm: exact rewrite refused: {exc}") from None
        return _approximate(model, cfg, ctx, str(exc))

    wins = probe_windows(ctx.calibration, cfg.exactness, fallback=ctx.train_ids,
                         vocab=model.get_input_embeddings().num_embeddings)
    probe = ExactnessProbe.before(model, wins, cfg.exactness)
    record = fold_exact(model, plan)
    facts = {
        "mode": "exact",
        "arch": plan.arch,
        "norms_replaced": len(record["norms"]),
        "added_bias": record["added_bias"],
        "untied_head": record["untied_head"],
        "notes": plan.notes,
        "reload": "optimize.rewrites.layernorm_fold.load_rewritten(dir)",
    }
    facts["exactness"] = probe.after(model, f"rmsnorm (exact LayerNorm->RMSNorm rewrite of {plan.arch})")
    ctx.details.update(facts)
    ctx.log(f"rmsnorm: exact fold on {plan.arch}: {len(record['norms'])} LayerNorms -> RMSNorm")
    return model


def _approximate(model: nn.Module, cfg: RMSNormConfig, ctx: StageContext, reason: str) -> nn.Module:
    msg = f"rmsnorm: approximate swap ({reason}); outputs change, the model needs healing"
    warnings.warn(msg, stacklevel=2)
    ctx.log(msg)
    teacher = copy.deepcopy(model).eval() if cfg.heal is not None and cfg.heal.loss == "distill" else None
    record = swap_approximate(model)
    facts = {"mode": "approximate", "arch": record["arch"], "norms_replaced": len(record["norms"]),
             "reason": reason, "reload": "optimize.rewrites.layernorm_fold.load_rewritten(dir)"}
    if cfg.heal is not None:
        facts["heal"] = finetune(model, cfg.heal, ctx.train_ids, teacher=teacher, seed=ctx.seed, who="heal", log=ctx.log,
                                 progress=ctx.progress)
        del teacher
    ctx.details.update(facts)
    return model

