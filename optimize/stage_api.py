"""The stage contract: a typed config plus a registered function ``(model, cfg, ctx) -> model``.

Stages only transform the model. The pipeline runner owns the baseline, checks, gates,
artifacts, the report and where the model lives (``ctx.device``, ``ctx.dtype``; see
:mod:`optimize.device`): a stage leaves the model where it found it and moves its own data
to the model. A stage that learns something worth reporting (chosen modules,
KV-cache bytes, training loss) puts JSON-serializable values into ``ctx.details``.

Writing a stage::

    class MyConfig(StageConfig):
        kind: Literal["my_stage"] = "my_stage"
        strength: float = Field(1.0, gt=0, description="...")

    @register_stage("my_stage", MyConfig)
    def my_stage(model, cfg: MyConfig, ctx: StageContext):
        '''One line shown by `optimize ls stages`.'''
        ...
        return model
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import Field

from targets.config_base import Strict
from optimize.gates_config import GatesConfig

log = logging.getLogger("optimize")


class StageConfig(Strict):
    """Fields every stage accepts, besides its own."""

    kind: str
    name: str | None = Field(None, description="label in the report; defaults to the kind")
    gates: GatesConfig | None = Field(
        None, description="gates for this stage, replacing the pipeline-wide ones metric by metric"
    )

    def quant_scheme(self) -> str | None:
        """The quantization scheme this stage leaves in the model, checked against the target."""
        return None

    def label(self, index: int) -> str:
        return self.name or f"{index}:{self.kind}"

    def check_model(self, config: Any, target: Any | None) -> list[str]:
        """Problems this stage would hit on a model with this transformers ``config`` (as the
        earlier stages leave it; see :meth:`planned_config`) for ``target`` (a TargetProfile or
        None). Run by ``optimize validate`` and before the first stage, so a stage that cannot
        work is refused before any work is done. Each problem is one sentence; [] = fine."""
        return []

    def planned_config(self, config: Any) -> Any:
        """The config of the model after this stage, for checking the stages after it and the
        exporter. Stages that change shapes or structure (head counts, widths, depth, norms)
        return an updated copy; the default is unchanged."""
        return config


@dataclass
class StageContext:
    """What a stage may use besides the model. Read-only by convention, except ``details``."""

    tokenizer: Any
    #: calibration token windows (each a 1-D LongTensor), disjoint from evaluation text
    calibration: list[torch.Tensor]
    #: training text for stages that heal or distil (1-D LongTensor), disjoint from evaluation
    train_ids: torch.Tensor
    target: Any | None  # targets.TargetProfile
    work_dir: Path
    seed: int = 0
    #: the model as it entered the pipeline, for teachers; do not modify it. Set only for stages
    #: registered with ``uses_baseline=True`` (None otherwise: no second copy of a large model)
    baseline_model: torch.nn.Module | None = None
    details: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = log.info
    #: where the stage computes (the run's ``device``). The pipeline has put the model there;
    #: a stage moves its calibration and training data to the model, and a stage that works
    #: block by block may bring one block at a time here (None: wherever the model is)
    device: torch.device | None = None
    #: the floating dtype the pipeline keeps the weights in (the run's ``compute_dtype``), for
    #: tensors a stage creates (None: the model's own)
    dtype: torch.dtype | None = None
    #: where :meth:`progress` goes: set by the pipeline to an emitter bound to this stage's row
    #: (:meth:`optimize.progress.Progress.for_stage`); None drops the events
    on_progress: Callable[..., Any] | None = None
    #: a directory where a stage may keep content-keyed results for other runs (the pipeline sets
    #: it with ``stage_cache: true``; GPTQ keeps the decoder blocks' results there); None: keep nothing
    cache_dir: Path | None = None

    def progress(self, step: int | None = None, total: int | None = None, *, phase: str = "stage",
                 event: str = "step", loss: float | None = None, tokens_per_s: float | None = None,
                 message: str | None = None, **fields: Any) -> None:
        """Report progress of a long stage: ``ctx.progress(step, total, loss=..., tokens_per_s=...)``
        per step (``phase`` names the part: ``train``, ``calibrate``, ``layers``...), and
        ``event="begin"``/``"end"`` around a phase. On a terminal (``progress=True``) this draws
        a bar with the ETA; a ``run_pipeline(callback=...)`` receives each event as a
        :class:`~optimize.progress.ProgressEvent`. Cheap when nobody listens."""
        if self.on_progress is not None:
            self.on_progress(step, total, phase=phase, event=event, loss=loss, tokens_per_s=tokens_per_s,
                             message=message, **fields)


@dataclass(frozen=True)
class StageSpec:
    kind: str
    config_cls: type[StageConfig]
    fn: Callable[[torch.nn.Module, StageConfig, StageContext], torch.nn.Module]
    description: str
    #: re-applies the stage's structural change (no weights) to a freshly built model, so a
    #: checkpoint saved after this stage can be loaded on resume; None if only weights change
    restore: Callable[[torch.nn.Module, StageConfig], None] | None = None
    #: reads ``ctx.baseline_model`` (a teacher): only then does the pipeline keep a copy of the
    #: model as it entered, so a run without such a stage holds one model, not two
    uses_baseline: bool = False


_STAGES: dict[str, StageSpec] = {}


def register_stage(
    kind: str,
    config_cls: type[StageConfig],
    description: str | None = None,
    *,
    restore: Callable[[torch.nn.Module, StageConfig], None] | None = None,
    uses_baseline: bool = False,
):
    """Register ``fn`` as the handler for stage ``kind`` (config class ``config_cls``).

    ``restore`` is needed only by stages that change module structure beyond what the
    saved HF config rebuilds (quantized tensor subclasses, swapped module classes).
    ``uses_baseline``: the stage reads ``ctx.baseline_model``; other stages get None there."""

    def deco(fn):
        if kind in _STAGES:
            raise ValueError(f"stage kind {kind!r} is registered twice")
        ann = config_cls.model_fields.get("kind")
        if ann is None or ann.default != kind:
            raise TypeError(f"{config_cls.__name__}.kind must default to {kind!r}")
        doc = (fn.__doc__ or "").strip()
        desc = description or (doc.splitlines()[0] if doc else "")
        _STAGES[kind] = StageSpec(kind, config_cls, fn, desc, restore, uses_baseline)
        return fn

    return deco


def registered_stages() -> dict[str, StageSpec]:
    """All stage kinds: the built-ins plus modules named in ``$OPTIMIZE_PLUGINS``
    (comma-separated import paths of third-party stage modules)."""
    import importlib
    import os

    from targets.quiet_imports import import_quietly

    import_quietly()  # the built-ins import transformers and torchao: their import noise must not reach the caller
    # the one import that runs up the house, on purpose: the registry is below the stages that
    # register in it (each imports StageContext and register_stage from here), and loads them on first use
    import optimize.stages  # noqa: F401  (registers the built-ins)

    for module in filter(None, (m.strip() for m in os.environ.get("OPTIMIZE_PLUGINS", "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"OPTIMIZE_PLUGINS names {module!r}, which does not import: {exc}") from exc
    return dict(sorted(_STAGES.items()))


def get_stage(kind: str) -> StageSpec:
    stages = registered_stages()
    if kind not in stages:
        raise KeyError(f"unknown stage kind {kind!r}; registered: {', '.join(stages)}")
    return stages[kind]


def restorers(stage_cfgs) -> list[Callable[[torch.nn.Module], None]]:
    """What rebuilds a checkpointed model after ``stage_cfgs`` (each stage's ``restore``, in order):
    a stage that changed the model's layout (an RMSNorm rewrite, fake-quantized layers) says how its
    saved state dict is loaded back. Used by every reader of stage checkpoints: the pipeline's resume
    and ``optimize fit``'s measurement after finished stages."""
    out = []
    for stage_cfg in stage_cfgs:
        spec = get_stage(stage_cfg.kind)
        if spec.restore is not None:
            out.append(lambda m, s=spec, c=stage_cfg: s.restore(m, c))
    return out
