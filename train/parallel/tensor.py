"""Megatron-style tensor parallelism for Llama-family blocks, through ``torch.distributed.tensor.parallel``.

Each block's q/k/v and gate/up projections are split by output columns and o/down by input rows,
so attention runs on ``heads / tp`` local heads and the MLP on ``intermediate / tp`` local columns,
with one reduction after o_proj and one after down_proj. With ``sequence_parallel`` the norms and
the residual stream between them are sharded over the sequence instead of replicated (the
reductions become reduce-scatters, and an all-gather feeds attention and the MLP): norm
activations take ``1 / tp`` of the memory.

The residual stream enters the first block whole and leaves the last block whole: the rotary
tables and the causal mask are built from the full sequence, a pipeline stage hands whole
hidden states to the next, and the final norm, the output head (replicated) and the loss,
chunked or not, see gathered hidden states once. Every tp rank computes the same
loss; the head's weight stays whole, so tied embeddings keep working.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWS = ("self_attn.o_proj", "mlp.down_proj")


def _norms(block: nn.Module) -> list[str]:
    """The block's own norms (direct children): Qwen3's per-head q_norm/k_norm live inside
    attention, on local heads over the whole sequence, and must stay out of the sequence split."""
    return [name for name, child in block.named_children() if "Norm" in type(child).__name__]


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    """The parallel style of each part of one decoder block."""
    out = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {name: ColwiseParallel() for name in _COLUMNS}
    plan.update({name: RowwiseParallel(output_layouts=out) for name in _ROWS})
    if sequence_parallel:
        # local outputs: Gemma-2/3's sandwich norms feed the residual add directly, not a projection
        plan.update({name: SequenceParallel(use_local_output=True) for name in _norms(block)})
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def _blocks(base: nn.Module) -> list[nn.Module]:
    layers = base.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Split ``model`` (an HF causal LM, or a pipeline stage of one) over ``tp_mesh`` in place."""
    base = model.model
    blocks = _blocks(base)
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
    if sequence_parallel and blocks:
        # the stream is whole until the first block (rotary tables and the mask come from it) and
        # whole again after the last (the final norm, the head and the loss; a pipeline stage's
        # output): one scatter and one gather per stage
        parallelize_module(
            blocks[0], tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
        )
        parallelize_module(
            blocks[-1],
            tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
        )
    return model
