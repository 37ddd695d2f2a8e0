"""The global gradient norm over every mesh dimension, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` needs every gradient on one mesh with one placement: expert
gradients (sharded over ``ep``) and dense ones (over ``dp_shard`` and ``tp``) are not, and a
pipeline stage holds only its own blocks' gradients. Here the squared norms are summed per
mesh (each DTensor group reduces over its own mesh), the groups are added, and the pipeline's
stages add theirs with one all-reduce over ``pp``, so every rank clips by the norm of the whole
model's gradient, as the single-process loop does.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.parallel.mesh import ParallelMesh


def _group_key(g: torch.Tensor):
    if isinstance(g, DTensor):
        return (id(g.device_mesh), tuple(g.placements))
    return None


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` with gradients, grouped so that each group's gradients share mesh and placements."""
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[_group_key(p.grad)].append(p)
    return list(groups.values())


def total_grad_norm(params: list[torch.Tensor], pmesh: ParallelMesh) -> torch.Tensor:
    """The 2-norm of all of ``params``' gradients across the mesh (a scalar tensor, equal on every rank)."""
    device = next((p.device for p in params), torch.device("cpu"))
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for group in _by_mesh(params):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float().to(device) ** 2
    if pmesh.layout.pp > 1:
        dist.all_reduce(squared, group=pmesh.dim("pp").get_group())
    return squared.sqrt()


def clip_grads(params: list[torch.Tensor], max_norm: float | None, pmesh: ParallelMesh) -> torch.Tensor:
    """Scale the gradients so their global norm is at most ``max_norm``; returns the norm before."""
    norm = total_grad_norm(params, pmesh)
    if max_norm:
        for group in _by_mesh(params):  # one foreach multiply per mesh: DTensor ops never mix meshes
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
