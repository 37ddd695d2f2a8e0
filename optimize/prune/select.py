"""Turning importance scores into what to keep, respecting GQA groups.

Query head ``h`` reads KV head ``h // (H / KV)``, so heads are kept group by group: whole KV
groups ranked by the summed importance of their query heads, then, inside every kept group,
the same number of query heads ranked by their own importance. Every block keeps the same
counts, because a transformers config has one head count and one MLP width for all blocks.
"""

from __future__ import annotations

import torch


def keep_blocks(scores: list[float], keep: int) -> list[int]:
    """Indices of the ``keep`` highest-scoring blocks, in model order."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(order[:keep])


def keep_heads(importance: torch.Tensor, kv_heads: int, keep_kv: int, keep_per_group: int) -> tuple[list[int], list[int]]:
    """(query heads kept, KV heads kept) of one block, both sorted."""
    heads = importance.numel()
    group = heads // kv_heads
    per_group = importance.reshape(kv_heads, group)
    groups = sorted(torch.topk(per_group.sum(-1), keep_kv).indices.tolist())
    kept: list[int] = []
    for g in groups:
        inside = torch.topk(per_group[g], keep_per_group).indices.tolist()
        kept += sorted(g * group + j for j in inside)
    return kept, groups


def keep_channels(importance: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` most important MLP channels of one block, sorted."""
    return torch.sort(torch.topk(importance, keep).indices).values


def kept_mlp_width(intermediate: int, ratio: float, multiple: int) -> int:
    """MLP channels left after removing ``ratio`` of them, rounded down to ``multiple``
    (XNNPACK's 4-bit kernels want whole 32-channel groups in ``down_proj``)."""
    keep = int(intermediate * (1.0 - ratio))
    return (keep // multiple) * multiple if multiple > 1 else keep
