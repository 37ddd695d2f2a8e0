"""Expert parallelism for transformers' mixture-of-experts layers: each ep rank holds E / ep experts.

transformers (5.x) stores a MoE block's experts stacked: ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` in one experts module (Mixtral, Qwen2/3-MoE, OLMoE), called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` after the router. Here those
two parameters become DTensors sharded on dim 0 over the ``ep`` mesh dimension, and the module
runs Megatron's all-gather token dispatcher: the ep ranks gather each other's routed tokens
(their hidden states, expert ids and routing weights), each rank runs its own experts on the
tokens routed to them, and a reduce-scatter sums the experts' weighted outputs and hands every
rank back its own tokens. Both collectives are the autograd-aware functional ones, so backward
is the mirror image (a reduce-scatter of the input gradients, an all-gather of the output's).
The router and everything else stay dense and data-parallel.

Why all-gather rather than all-to-all: it needs no per-step exchange of token counts and gives
the same numbers, at ep times the token traffic of an all-to-all; for the small ep degrees of
one node that is the simpler, deterministic choice.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd, reduce_scatter_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from targets.moe import is_fused_experts


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The stacked-experts modules of ``model`` (empty for a dense model; ``targets.moe``'s test,
    whose :func:`~targets.moe.check_layout` refuses the layouts this forward does not compute)."""
    return [module for module in model.modules() if is_fused_experts(module)]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _ep_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Gather the group's routed tokens, run the local experts on theirs, reduce-scatter the sums.

    Every rank must issue the same collectives in the same order in backward too, and autograd
    orders backward by the graph's structure: so the graph must not depend on the routing. Each
    local expert runs even when no token chose it (on an empty batch), where transformers skips
    it; and the hidden states and routing weights travel as one fp32 tensor (fp32 holds bf16
    exactly) through one differentiable all-gather, not two whose backward reduce-scatters could
    come in either order. Skipping an expert on one rank deadlocked gloo in the first backward.
    The expert ids need no gradient."""
    group = self.ep_group
    width = hidden.shape[-1]
    packed = torch.cat([hidden.float(), top_k_weights.float()], dim=-1)
    gathered = all_gather_single_autograd(packed, 0, group)
    all_hidden = gathered[:, :width].to(hidden.dtype)
    all_weights = gathered[:, width:]
    with torch.no_grad():
        all_index = all_gather_single_autograd(top_k_index, 0, group)
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    first = self.ep_first_expert
    out = torch.zeros_like(all_hidden)
    for e in range(gate_up.shape[0]):
        token_idx, top_k_pos = torch.where(all_index == first + e)  # may be empty: still run (see above)
        gate, up = nn.functional.linear(all_hidden[token_idx], gate_up[e]).chunk(2, dim=-1)
        y = nn.functional.linear(self.act_fn(gate) * up, down[e])
        y = y * all_weights[token_idx, top_k_pos, None]
        out = out.index_add(0, token_idx, y.to(out.dtype))
    return reduce_scatter_single_autograd(out, "sum", 0, group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Shard every experts module of ``model`` over ``ep_mesh`` in place; returns them (FSDP2
    wraps them on their own mesh)."""
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = expert_modules(model)
    for module in modules:
        experts = module.gate_up_proj.shape[0]
        per = experts // size
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            local = full.detach()[rank * per:(rank + 1) * per].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        module.ep_group = ep_mesh.get_group()
        module.ep_first_expert = rank * per
        module.forward = types.MethodType(_ep_forward, module)
    return modules
