"""The pipeline's ``draft`` block: a small model for speculative decoding, made by stages of its own.

The draft starts from a copy of the model as loaded, after the pipeline's own stages, and runs the
block's stages (typically a depth ``prune``, a ``distill`` whose teacher is the model as loaded, a
``ptq_int8`` like the target's). Each is a row like a stage's (``draft:<i>:<kind>``: measured against
the baseline, gated by the block's own gates only, checkpointed under ``<run>/stages/draft-...``, so a
killed run resumes mid-draft), and the result goes to the exporter beside the target
(:class:`export.base.DraftSpec`; an ExecuTorch program's ``draft`` method).

Why apart from :mod:`optimize.stage_rows`: that module runs any sequence of stages; this one says
which sequence the draft is, what keys its checkpoints, and what the exporter gets with it.
"""

from __future__ import annotations

import copy
import hashlib
import json

import torch

from optimize.measure import RunState
from optimize.report import Report
from optimize.stage_rows import StageSeq, run_stages

#: report rows of the draft are named ``draft:<stage label>``
ROW_PREFIX = "draft:"


def draft_digest(config_dump: dict, upto: int | None = None) -> str:
    """What determines the draft after its stage ``upto`` (default: the last): the model as loaded, the
    data, the seed and the draft's stages (not the pipeline's, which the draft does not start from)."""
    stages = (config_dump.get("draft") or {}).get("stages", [])
    upto = len(stages) - 1 if upto is None else upto
    key = {"model": config_dump.get("model"), "data": config_dump.get("data"), "seed": config_dump.get("seed"),
           "compute_dtype": config_dump.get("compute_dtype"),
           "draft": [{k: v for k, v in s.items() if k not in ("name", "gates")} for s in stages[: upto + 1]]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def draft_stages(state: RunState, config_dump: dict) -> StageSeq:
    """The draft block's stages as a :class:`~optimize.stage_rows.StageSeq`: its own gates (never the
    pipeline-wide ones: a draft is far from the baseline by design), no stage cache."""
    draft = state.cfg.draft
    digests = [draft_digest(config_dump, i) for i in range(len(draft.stages))]
    dirs = [state.run_dir / "stages" / f"draft-{i:02d}-{s.kind}-{d}"
            for i, (s, d) in enumerate(zip(draft.stages, digests))]
    names = [ROW_PREFIX + s.label(i) for i, s in enumerate(draft.stages)]
    return StageSeq(list(draft.stages), digests, dirs, names, draft.gates, cacheable=False, desc="draft stages")


def run_draft(state: RunState, report: Report, loaded: torch.nn.Module, *, config_dump: dict,
              device: torch.device, dtype: torch.dtype, progress: bool) -> torch.nn.Module | None:
    """The draft model: ``loaded`` (the model as loaded; the teacher of its distill stages, never
    modified) copied and taken through the draft block's stages. None where a draft row's gate or error
    stopped the run."""
    state.say(f"draft: {len(state.cfg.draft.stages)} stage(s) from the model as loaded")
    quantized = state.quantized  # the target's: whether its eager rows were timed
    state.quantized = False
    try:
        return run_stages(state, report, copy.deepcopy(loaded), config_dump=config_dump, baseline_model=loaded,
                          device=device, dtype=dtype, progress=progress, seq=draft_stages(state, config_dump))
    finally:
        state.quantized = quantized


def token_counts(state: RunState, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the run's training and calibration text (never the
    evaluation span): what a draft head over part of the vocabulary keeps."""
    pieces = [state.train_ids.reshape(-1)] + [w.reshape(-1) for w in state.calibration]
    ids = torch.cat([p.long() for p in pieces]) if pieces else torch.zeros(0, dtype=torch.long)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    return torch.bincount(ids, minlength=vocab_size)
