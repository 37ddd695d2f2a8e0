"""What earlier ``prune`` stages did, read back from ``config.pruning`` (saved in config.json).

Stages after pruning need it: distillation matches each block of a depth-pruned student to
the teacher block it came from, and any fine-tune must keep pruned weights at zero (a
gradient step would otherwise refill them and undo the sparsity).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STRUCTURED = ("depth", "width")
SPARSE = ("unstructured", "semi_structured")


def history(config: Any) -> list[dict]:
    return list(getattr(config, "pruning", None) or [])


def layer_map(student: Any, teacher: Any, n_student: int, n_teacher: int) -> tuple[dict[int, int], str]:
    """Student block -> teacher block, and how it was derived.

    If the student's pruning history extends the teacher's (the teacher is the model before
    this pipeline's prune stages), the depth records say which teacher blocks each student
    block came from. Otherwise blocks are spread evenly (the last maps to the last)."""
    s_hist, t_hist = history(student), history(teacher)
    if s_hist[: len(t_hist)] == t_hist:
        mapping = list(range(n_teacher))
        for rec in s_hist[len(t_hist):]:
            if rec.get("method") == "depth":
                mapping = [mapping[k] for k in rec["kept_layers"]]
        if len(mapping) == n_student:
            derived = "pruning record" if mapping != list(range(n_teacher)) else "identity"
            return dict(enumerate(mapping)), derived
    return {j: round((j + 1) * n_teacher / n_student) - 1 for j in range(n_student)}, "uniform"


def sparse_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """Keep-masks (weight != 0) of the Linear layers sparse prune stages zeroed, by parameter
    name; records followed by a structured prune (which renames or reshapes layers) are skipped."""
    records = history(model.config) if hasattr(model, "config") else []
    last_structured = max((i for i, r in enumerate(records) if r.get("method") in STRUCTURED), default=-1)
    params = dict(model.named_parameters())
    masks: dict[str, torch.Tensor] = {}
    for rec in records[last_structured + 1:]:
        if rec.get("method") not in SPARSE:
            continue
        for name in rec.get("modules", []):
            p = params.get(f"{name}.weight")
            if p is not None and type(p.data) is torch.Tensor:
                masks[f"{name}.weight"] = p.detach() != 0
    return masks


def kept_hidden(student: Any, teacher: Any) -> list[int] | None:
    """Teacher residual-stream channels the student's channels came from (width prune records
    beyond the teacher's history), or None when no record says so."""
    s_hist, t_hist = history(student), history(teacher)
    if s_hist[: len(t_hist)] != t_hist:
        return None
    mapping = None
    for rec in s_hist[len(t_hist):]:
        if rec.get("method") == "width" and rec.get("kept_hidden") is not None:
            kept = rec["kept_hidden"]
            mapping = kept if mapping is None else [mapping[k] for k in kept]
    return mapping
