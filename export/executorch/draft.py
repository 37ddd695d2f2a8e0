"""A draft model inside the target's ``.pte``: the ``draft`` method speculative decoding drafts with.

The pipeline's ``draft`` block makes a small model from the loaded one (a depth- or width-pruned copy
healed by distillation: :mod:`optimize.draft_rows`); the exporter lowers it beside the target as one
more method of the same program, with a KV cache of its own:

``draft(tokens[1, T], input_pos[T]) -> logits[1, 1, V']`` (the last fed position), ``T`` up to the
prefill chunk, so the draft prefills a prompt in the calls the target does.

Why one program: ExecuTorch stores a constant once however many methods read it (the emitter and
XNNPACK's named data both key it by its bytes), so a draft whose embedding table (and, without a
partial vocabulary, head) is the target's (frozen while it was healed, quantized alike) adds only
its own blocks to the file. Its cache buffers sit under ``draft.`` so they are never the target's
(``forward`` and ``verify`` share theirs by name).

``draft_vocab: N`` gives the draft a head over the ``N`` tokens it will most often need (the run's
text by frequency, then the lowest ids: a BPE vocabulary's earliest merges), rows of its own head:
a draft token reads ``N`` rows instead of the whole vocabulary's, which is most of a small draft's
cost. Its index -> token id map is the constant method ``get_draft_vocab``. A token outside it is
never drafted, so the target's choice there is never a proposal: output is unchanged, only
acceptance pays.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from export.base import ExportError

from export.executorch.runner import DRAFT_METHOD  # noqa: E402,F401  (the method this module fills)
#: constant method: the draft head's row -> token id (only with draft_vocab)
DRAFT_VOCAB_META = "get_draft_vocab"


class DraftDecoder(nn.Module):
    """An :class:`~export.executorch.llm.ExecuTorchDecoder` whose buffers are named ``draft.*``:
    the memory planner shares mutable buffers between methods by name (``verify`` continues
    ``forward``'s cache), and the draft's cache must stay its own."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.draft = decoder
        object.__setattr__(self, "model", decoder.model)  # for messages; not a second registration

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.draft(tokens, input_pos)


def vocabulary(counts: torch.Tensor | None, vocab_size: int, n: int, keep: Sequence[int] = ()) -> list[int]:
    """The ``n`` token ids a partial draft head covers, ascending: ``keep`` (special tokens: a draft
    must be able to propose an end of sequence), then the most frequent in ``counts`` (occurrences per
    id in the run's text), then the lowest ids not yet chosen (a BPE vocabulary's earliest merges are
    its most common pieces)."""
    if not 1 <= n <= vocab_size:
        raise ExportError(f"draft_vocab={n} must be between 1 and the vocabulary's {vocab_size} tokens")
    chosen: dict[int, None] = {int(t): None for t in keep if 0 <= int(t) < vocab_size}
    if len(chosen) > n:
        raise ExportError(f"draft_vocab={n} is smaller than the {len(chosen)} special tokens it must cover")
    if counts is not None and counts.numel():
        c = counts[:vocab_size].to(torch.float64)
        for t in torch.argsort(c, descending=True, stable=True).tolist():
            if c[t] <= 0 or len(chosen) >= n:
                break
            chosen.setdefault(int(t), None)
    t = 0
    while len(chosen) < n:
        chosen.setdefault(t, None)
        t += 1
    return sorted(chosen)


def rows_of(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a Linear weight, plain or torchao-quantized (the quantized data, scales and zero
    points of those rows as they are: a row keeps its exact integers)."""
    names = getattr(weight, "tensor_data_names", None)
    if names is None:
        return weight.detach()[ids].clone()
    block = getattr(weight, "block_size", None)
    if block is not None and block[0] != 1:
        raise ExportError(f"the draft head's {type(weight).__name__} quantizes blocks of {block[0]} rows; a partial "
                          "vocabulary needs row-wise or group-wise scales")
    data = [getattr(weight, n)[ids].clone() for n in names]
    attrs = [getattr(weight, a) for a in weight.tensor_attribute_names]
    return type(weight)(*data, *attrs)


def restrict_head(model: nn.Module, ids: list[int]) -> None:
    """Give ``model`` an output projection over ``ids`` only (in place; the input embedding is kept,
    so a tied pair is untied). Gemma-2-style final soft-capping is elementwise and unaffected."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ExportError(f"draft_vocab: the draft's output projection is {type(head).__name__}, not an nn.Linear")
    idx = torch.tensor(ids, dtype=torch.long)
    new = nn.Linear(head.in_features, len(ids), bias=head.bias is not None)
    new.weight = nn.Parameter(rows_of(head.weight, idx), requires_grad=False)
    if head.bias is not None:
        new.bias = nn.Parameter(head.bias.detach()[idx].clone(), requires_grad=False)
    model.set_output_embeddings(new)
    model.config.tie_word_embeddings = False
    if getattr(model.config, "get_text_config", None) is not None:
        model.config.get_text_config(decoder=True).tie_word_embeddings = False
    model.config.vocab_size = int(model.get_input_embeddings().num_embeddings)


def _tensor_parts(t: torch.Tensor) -> list[torch.Tensor]:
    names = getattr(t, "tensor_data_names", None)
    return [getattr(t, n) for n in names] if names else [t]


def _digest(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous().cpu()
    return (str(t.dtype), tuple(t.shape), hash(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0)


def own_bytes(draft: nn.Module, target: nn.Module) -> dict[str, Any]:
    """What the draft adds to the program: the bytes of its weights (quantized data, scales) whose exact
    contents the target does not hold, and those it shares (stored once)."""
    have = {_digest(p) for m in (target,) for t in list(m.parameters()) + list(m.buffers())
            for p in _tensor_parts(t)}
    own = shared = 0
    seen = set()
    for t in list(draft.parameters()) + list(draft.buffers()):
        for p in _tensor_parts(t):
            d = _digest(p)
            if d in seen:
                continue
            seen.add(d)
            n = p.numel() * p.element_size()
            if d in have:
                shared += n
            else:
                own += n
    return {"own_bytes": own, "shared_bytes": shared}
