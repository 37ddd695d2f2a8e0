"""Pre-flight checks the stages share: what a model's config alone tells about a stage.

The checks run the stages' own planning code (fold groups, LayerNorm plans, ptq_int8's layer
selection) on a weightless copy of the model built on the meta device from its config
(:func:`train.model_parts.meta_model`), so validation and the run refuse the same things with
the same sentences, and nothing is loaded.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch import nn

from optimize.quant.equalize import fold_groups
from optimize.quant.fold_layouts import FoldRefused, layout_for
from targets.moe import ExpertsRefused, unfuse_experts
from train.model_parts import meta_model

log = logging.getLogger("optimize")


def meta_or_none(config: Any) -> nn.Module | None:
    """The weightless model of ``config``, or None when it cannot be built without weights
    (custom code, an unmapped class): the stage's own run-time checks still refuse it then."""
    try:
        return meta_model(config)
    except Exception as exc:  # transformers raises many kinds for configs it cannot build
        log.info("pre-flight: cannot build %s on the meta device (%s); stage checks deferred to the run",
                 getattr(config, "model_type", "?"), exc)
        return None


def with_meta_model(config: Any, check: Callable[[nn.Module], list[str]], split_experts: bool = False) -> list[str]:
    """``check(meta model)``, or [] when there is no meta model (see :func:`meta_or_none`).

    ``split_experts``: a mixture of experts is checked as the stage will see it, its fused expert
    weights split into per-expert Linears (:func:`targets.moe.unfuse_experts`; the stages that do
    that first: ptq_int8, smoothquant, awq, rotate); a layout that cannot be split is the problem."""
    model = meta_or_none(config)
    if model is None:
        return []
    if split_experts:
        try:
            unfuse_experts(model)
        except ExpertsRefused as exc:
            return [str(exc)]
    return check(model)


def split_experts(model: nn.Module, cfg: Any = None) -> list[str]:
    """A stage's first step where it works on Linears, and its ``restore`` for checkpoints: a mixture's
    experts as one Linear per expert projection (the same function; :mod:`targets.moe`)."""
    return unfuse_experts(model)


def on_fold_layout(config: Any, check: Callable[[nn.Module], list[str]]) -> list[str]:
    """``check(meta model)`` for an architecture whose fold layout is known (``fold_layouts``); the
    layout's refusal, or a ``FoldRefused`` the check raises, as the one problem otherwise. What every
    stage that folds into the norms (smoothquant, awq, rotate) asks before it runs."""
    try:
        layout_for(config)
    except FoldRefused as exc:
        return [str(exc)]

    def guarded(model: nn.Module) -> list[str]:
        try:
            return check(model)
        except FoldRefused as exc:
            return [str(exc)]

    return with_meta_model(config, guarded, split_experts=True)


def fold_problems(config: Any, folds: list[str] | tuple[str, ...]) -> list[str]:
    """Why the equalization folds (smoothquant, awq) cannot apply to this architecture, if so."""
    def check(model: nn.Module) -> list[str]:
        fold_groups(model, tuple(folds))
        return []

    return on_fold_layout(config, check)
