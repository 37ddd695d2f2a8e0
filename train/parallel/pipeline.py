"""Pipeline parallelism through ``torch.distributed.pipelining``: the decoder blocks split into stages.

Each pp rank keeps only its own stage of the Hugging Face model, in place: the first stage the
input embedding, the last the final norm and the output head, every stage a contiguous run of
blocks. The kept blocks stay under their original names (``model.layers.<i>`` in an
``nn.ModuleDict`` keyed by the original index), so checkpoints written by any layout load into
any other (DCP matches parameters by name). A stage's forward rebuilds what the base model's
forward does around its blocks (rotary tables, the causal mask) from the full sequence, so a
stage takes token ids (first) or hidden states and returns hidden states or logits (last).

The schedules (GPipe, 1F1B) run ``batch.grad_accum_steps`` micro-batches per optimizer step and
scale the gradients by their count, which is the single-process loop's token-weighted mean for
equal micro-batches. With ``loss.chunked`` the last stage computes the chunked cross-entropy inside
its forward (as :func:`train.lm_head.head_loss` does for a whole model), so the last stage never
holds ``[tokens, vocab]`` logits.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from train.parallel.mesh import ParallelMesh

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def stage_blocks(num_layers: int, stages: int) -> list[range]:
    """Contiguous, balanced runs of blocks, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _mask_kind(block: nn.Module, config) -> str:
    """The mask a block attends with, as the base model picks it: its own ``attention_type``
    (Qwen2/3's per-layer types), else sliding-window wherever the config has a window (Mistral,
    Mixtral, Phi-3), else full causal."""
    kind = getattr(block, "attention_type", None)
    if kind is not None:
        return kind
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _stage_forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """A stage of an HF decoder: ids or hidden states in, hidden states or logits out; the last
    stage given ``labels`` returns the chunked cross-entropy instead of logits (see :func:`pipeline_step`)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    base = self.model
    h = base.embed_tokens(x) if base.embed_tokens is not None else x
    position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    kw = dict(config=base.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=position_ids)
    masks = {}
    for kind in dict.fromkeys(self.stage_mask_kinds):  # first-seen order, the same in every rank
        masks[kind] = (create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask)(**kw)
    position_embeddings = base.rotary_emb(h, position_ids=position_ids)
    for block, kind in zip(base.layers.values(), self.stage_mask_kinds):
        h = block(h, attention_mask=masks[kind], position_embeddings=position_embeddings, position_ids=position_ids)
    if base.norm is None:
        return h
    h = base.norm(h)
    if labels is None:
        return self.lm_head(h)
    from train.chunked_loss import chunked_cross_entropy
    from train.lm_head import lm_head_of

    # inside the forward, where FSDP2 has the head's weight gathered: full logits never exist
    return chunked_cross_entropy(h, lm_head_of(self), labels, chunk_size=self.stage_loss_chunk)


def keep_stage(model: nn.Module, pmesh: ParallelMesh) -> nn.Module:
    """Reduce ``model`` to this rank's pipeline stage, in place (the rest is freed)."""
    stages, rank = pmesh.layout.pp, pmesh.pp_rank
    base = model.model
    own = stage_blocks(len(base.layers), stages)[rank]
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in own})
    model.stage_mask_kinds = [_mask_kind(block, base.config) for block in base.layers.values()]
    if rank > 0:
        base.embed_tokens = None
    if rank < stages - 1:
        base.norm = None
        model.lm_head = None
    model.forward = types.MethodType(_stage_forward, model)
    model.pipeline_stage = (rank, stages)
    return model


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: mean next-token cross-entropy over one micro-batch, in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def computed_loss(loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's loss when the stage computed it itself (the chunked loss)."""
    return loss


def build_schedule(stage_module: nn.Module, pmesh: ParallelMesh, device: torch.device, schedule: str,
                   micro_batches: int, loss_chunk: int | None = None):
    """The pipelining schedule that runs this rank's stage. With ``loss_chunk`` the last stage
    computes the chunked cross-entropy inside its forward (it gets the labels as a keyword, split
    into micro-batches by the schedule like the inputs), else it returns logits to ``lm_loss``."""
    from torch.distributed import pipelining

    rank, stages = stage_module.pipeline_stage
    stage_module.stage_loss_chunk = loss_chunk
    stage = pipelining.PipelineStage(stage_module, rank, stages, device, group=pmesh.dim("pp").get_group())
    cls = getattr(pipelining, SCHEDULES[schedule])
    return Pipeline(cls(stage, n_microbatches=micro_batches, loss_fn=computed_loss if loss_chunk else lm_loss),
                    chunked=bool(loss_chunk))


@dataclass
class Pipeline:
    """This rank's schedule, and whether its last stage computes the chunked loss itself."""

    schedule: object
    chunked: bool = False


def pipeline_step(pipeline: Pipeline, pmesh: ParallelMesh, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward and backward of one optimizer step's windows; the mean loss on the last stage, 0 elsewhere."""
    rank, stages = pmesh.pp_rank, pmesh.layout.pp
    losses: list[torch.Tensor] = []
    args = (batch["input_ids"],) if rank == 0 else ()
    kwargs = {}
    if rank == stages - 1:
        kwargs = {"target": batch["labels"], "losses": losses}
        if pipeline.chunked:  # split into micro-batches like the inputs, and handed to the last stage's forward
            kwargs["labels"] = batch["labels"]
    pipeline.schedule.step(*args, return_outputs=False, **kwargs)  # the losses are all we read
    if not losses:
        return torch.zeros((), dtype=torch.float32, device=batch["input_ids"].device)
    return torch.stack([loss.detach().float() for loss in losses]).mean()
