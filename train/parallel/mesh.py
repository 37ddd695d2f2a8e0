"""One ``DeviceMesh`` for every parallel dimension, and where this rank sits on it.

The mesh is ``(pp, dp_mod_ep, ep, tp)`` with ``(dp_mod_ep, ep)`` flattened into ``dp_shard``
(torchtitan's layout; without expert parallelism ``ep`` has size 1): dense weights are
sharded over the whole ``dp_shard``, experts over ``ep``, and FSDP2 shards the experts' slices
further over ``dp_mod_ep``. All sub-meshes come from the one root, which is what FSDP2 and DTensor
need to compose (2-D parameters, one gradient norm).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train.parallel.layout import Layout


@dataclass
class ParallelMesh:
    root: DeviceMesh
    layout: Layout

    def dim(self, name: str) -> DeviceMesh:
        return self.root[name]

    @property
    def dp(self) -> DeviceMesh:
        return self.root["dp_shard"]

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.root["tp"].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.root["pp"].get_local_rank()

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def build_mesh(layout: Layout, device_type: str) -> ParallelMesh:
    """The root mesh for ``layout`` (every rank calls this; it creates the process sub-groups)."""
    root = init_device_mesh(
        device_type,
        (layout.pp, layout.dp_shard // layout.ep, layout.ep, layout.tp),
        mesh_dim_names=("pp", "dp_mod_ep", "ep", "tp"),
    )
    root["dp_mod_ep", "ep"]._flatten("dp_shard")
    return ParallelMesh(root=root, layout=layout)
