"""PyTorch's own distributed engine: process group from torchrun's env, device mesh, FSDP2.

The backend follows the device (NCCL on CUDA, gloo on CPU), so the same code runs under
``torchrun --nproc_per_node 2`` on a laptop and on a GPU node. Sharding is FSDP2
``fully_shard``: each transformer block first, then the root, so parameters are gathered
one block at a time. Teardown always destroys the process group, including on errors, so
a failing rank exits instead of leaving its peers blocked in a collective.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from train.config import DistributedConfig
from train.parallel.config import ParallelConfig
from train.errors import TrainInputError
from train.memory import transformer_blocks

log = logging.getLogger("optimize.train")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object | None = None
    owns_group: bool = False
    parallel: object | None = None  # train.parallel.mesh.ParallelMesh of a multi-dimensional layout

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that read different data."""
        return self.parallel.dp_rank if self.parallel is not None else self.rank

    @property
    def dp_world(self) -> int:
        return self.parallel.layout.dp_shard if self.parallel is not None else self.world

    @property
    def loss_weight(self) -> float:
        """This rank's share of the run's mean loss: the data-parallel mean over ranks that hold a
        loss; tensor-parallel copies and pipeline stages before the last count 0."""
        if self.parallel is None:
            return 1.0 / self.world
        p = self.parallel
        holds = p.is_last_stage and p.tp_rank == 0
        return 1.0 / p.layout.dp_shard if holds else 0.0


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainInputError("device: cuda was requested but CUDA is not available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(
    requested_device: str, cfg: DistributedConfig, parallel: ParallelConfig | None = None
) -> DistContext:
    """Join torchrun's process group when launched by it (WORLD_SIZE set); else single process.

    With a multi-dimensional ``parallel`` layout the mesh is :func:`train.parallel.mesh.build_mesh`'s
    (``ctx.parallel``); the sizes are checked against the world size first."""
    device = pick_device(requested_device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    multi = parallel is not None and parallel.multi_dim
    if world <= 1 and not cfg.fsdp and not multi:
        return DistContext(device=device)
    if "RANK" not in os.environ:
        what = "train.parallel" if multi else "distributed.fsdp"
        raise TrainInputError(f"{what} needs a launcher: run with `torchrun --nproc_per_node N -m train recipe.yaml`")
    layout = None
    if multi:
        from train.parallel.layout import resolve

        layout = resolve(parallel, world, cfg.fsdp)
    from torch.distributed.device_mesh import init_device_mesh

    owns = False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        owns = True
    pmesh = None
    if layout is not None:
        from train.parallel.mesh import build_mesh

        pmesh = build_mesh(layout, device.type)
        mesh = pmesh.dp
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return DistContext(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        device=device,
        mesh=mesh,
        owns_group=owns,
        parallel=pmesh,
    )


def teardown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a peer already gone must not mask the original error
            log.warning("destroy_process_group failed: %s", exc)


def _has_all_gather_extension(p: torch.Tensor) -> bool:
    """A tensor subclass that all-gathers its own inner tensors (torchao's NF4Tensor)."""
    return hasattr(p, "fsdp_pre_all_gather") and hasattr(p, "fsdp_post_all_gather")


def _single_rank_ignored(model: nn.Module, ctx: DistContext) -> set[nn.Parameter]:
    """Parameters FSDP2 must leave alone on a one-rank mesh, moved to the compute device.

    Why: FSDP2's world-size-1 fast path (``FSDPParamGroup.wait_for_unshard``) copies only the
    first all-gather input into a single output and then calls the subclass's
    ``fsdp_post_all_gather`` with it, but NF4Tensor all-gathers three inner tensors (scalers,
    factors, 4-bit data) and fails with "not enough values to unpack (expected 3, got 1)". On one
    rank there is nothing to shard, so these frozen parameters stay whole and unmanaged: the same
    bytes, the same NF4 matmul, the same (absent) gradient.
    """
    if ctx.world != 1:
        return set()
    ignored: set[nn.Parameter] = set()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not _has_all_gather_extension(p) or p.requires_grad:
                continue
            if p.device != ctx.device:  # distributed.cpu_offload leaves the model on the host
                p = nn.Parameter(p.to(ctx.device), requires_grad=False)
                setattr(module, name, p)
            ignored.add(p)
    return ignored


def apply_fsdp(model: nn.Module, cfg: DistributedConfig, ctx: DistContext, experts: list[nn.Module] = ()) -> nn.Module:
    """fully_shard every transformer block, then the root, with the configured policies.

    ``experts`` (already sharded over ``ep``) are sharded first over the data-parallel ranks left
    in each expert group (``dp_mod_ep``), or left out where none are left (their gradients need no
    reduction: each ep rank's experts saw every rank's tokens)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[cfg.param_dtype], reduce_dtype=_DTYPES[cfg.reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=ctx.mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=cfg.reshard_after_forward)
    nf4_whole = _single_rank_ignored(model, ctx)
    ignored = set(nf4_whole)
    if experts:
        layout = ctx.parallel.layout
        if layout.dp_shard // layout.ep > 1:
            for module in experts:
                fully_shard(module, **{**kwargs, "mesh": ctx.parallel.dim("dp_mod_ep")})
        else:
            ignored |= {p for module in experts for p in module.parameters()}
    if ignored:
        kwargs["ignored_params"] = ignored
    wrapper_of = {
        id(m._checkpoint_wrapped_module): m for m in model.modules() if hasattr(m, "_checkpoint_wrapped_module")
    }
    for block in transformer_blocks(model):
        fully_shard(wrapper_of.get(id(block), block), **kwargs)
    fully_shard(model, **kwargs)
    quantized = sum(type(getattr(p, "_local_tensor", p)).__name__ == "NF4Tensor" for p in model.parameters())
    if nf4_whole:
        log.info("FSDP2 on one rank: %d NF4 parameters kept whole (nothing to shard)", len(nf4_whole))
    elif quantized:
        log.info("FSDP2: %d parameters sharded per-parameter as NF4 (4-bit all-gather)", quantized)
    return model


def all_reduce_max(value: float, ctx: DistContext) -> float:
    if ctx.world <= 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
