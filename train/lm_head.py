"""The output head of a Hugging Face causal LM, seen from its final hidden states.

Why a module of its own: chunked losses (:mod:`train.chunked_loss`) and distillation
(:mod:`optimize.losses`) never form full ``[tokens, vocab]`` logits, so they need the head
(weight, bias, logit scale, soft-cap) and the hidden states it reads instead of the model's
logits. This module finds them, and refuses models whose head is not a plain Linear.

- :class:`LMHead` describes how logits come from hidden states;
- :func:`head_loss` runs the model and hands the head's input and the head to a loss *inside*
  the forward (the head runs on one position only; under FSDP2 its weight is the gathered one);
- :func:`lm_hidden_and_head` returns hidden states and head instead (single process only: after
  the forward FSDP2 may have resharded the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


class ChunkedLossError(ValueError):
    """The model's logits are not ``LMHead(final hidden states)``; use the plain loss."""


@dataclass
class LMHead:
    """``logits = softcap(scale * (hidden @ weight.T + bias))``: the output heads of HF causal LMs."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0  # Cohere's logit_scale, 1 / Granite's logits_scaling
    softcap: float | None = None  # Gemma-2/3's final_logit_softcapping


def _head_module(model: nn.Module) -> nn.Linear:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        raise ChunkedLossError(f"{type(model).__name__} has no output embeddings (lm_head); use the plain loss")
    if not isinstance(head, nn.Linear) or hasattr(head, "lora_A"):
        raise ChunkedLossError(
            f"the output head is a {type(head).__name__}, not a plain Linear (a LoRA adapter on lm_head?); "
            "leave lm_head out of lora.target_modules or set train.loss.chunked: false"
        )
    return head


def _transform(model: nn.Module) -> tuple[float, float | None]:
    """(scale, softcap) the model applies to its head's output."""
    config = getattr(model, "config", None)
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, float(softcap) if softcap else None


def lm_head_of(model: nn.Module) -> LMHead:
    """The output head of a (possibly peft-wrapped) HF causal LM, with its logit transform."""
    head = _head_module(model)
    return LMHead(head.weight, head.bias, *_transform(model))


def head_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    compute: Callable[[torch.Tensor, LMHead], torch.Tensor],
    *,
    keep_logits: bool = False,
    **kwargs,
) -> torch.Tensor:
    """``compute(final_hidden_states, head)`` evaluated inside ``model``'s forward.

    A forward pre-hook on the output head receives its input (the final hidden states, all
    positions) while the model's weights are live (FSDP2 has gathered them), calls ``compute``,
    and hands the head only the last position, so full logits are never formed. The value
    leaves the forward as the model's own ``loss`` output (through transformers' per-model
    ``loss_function``): FSDP2 hooks its pre-backward (which re-gathers the root's weights) onto
    forward outputs, and a tensor that left the forward any other way would reach backward with
    the head's weight already freed. With ``keep_logits`` (checks, no gradient) the head runs on
    every position and ``(value, output)`` is returned.
    """
    module = _head_module(model)
    scale, softcap = _transform(model)
    # the transformers model itself (inside peft/FSDP wrappers): its class defines loss_function
    hf = next((m for m in model.modules() if isinstance(getattr(type(m), "loss_function", None), property)), None)
    box: dict = {}

    def pre_hook(mod, args, kw):
        hidden = args[0] if args else kw.pop("input")
        box["value"] = compute(hidden, LMHead(mod.weight, mod.bias, scale, softcap))
        return ((hidden if keep_logits else hidden[..., -1:, :]),), kw

    def as_model_loss(*args, **kw):
        return box["value"]

    handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    own = hf.__dict__.get("_loss_function") if hf is not None else None
    if hf is not None and not keep_logits:
        hf.__dict__["_loss_function"] = as_model_loss
        kwargs["labels"] = input_ids  # makes the model call loss_function; the ids themselves are unused
    try:
        out = model(input_ids=input_ids, use_cache=False, **kwargs)
    finally:
        handle.remove()
        if hf is not None and not keep_logits:
            if own is None:
                hf.__dict__.pop("_loss_function", None)
            else:
                hf.__dict__["_loss_function"] = own
    if "value" not in box:
        raise ChunkedLossError(f"{type(model).__name__}'s forward never called its output head; use the plain loss")
    if keep_logits:
        return box["value"], out
    if getattr(out, "loss", None) is not box["value"]:
        if any(hasattr(m, "unshard") and hasattr(m, "reshard") for m in model.modules()):  # an FSDP2 module
            raise ChunkedLossError(
                f"{type(model).__name__} did not return the chunked loss as its own loss output, which FSDP2 "
                "needs to re-gather weights for backward; set train.loss.chunked: false"
            )
    return box["value"]


def final_hidden_states(model: nn.Module, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """``[batch, seq, hidden]`` states the output head reads, with logits computed for one position only."""
    try:
        out = model(input_ids=input_ids, use_cache=False, output_hidden_states=-1, logits_to_keep=1, **kwargs)
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        raise ChunkedLossError(
            f"{type(model).__name__} does not take output_hidden_states/logits_to_keep ({exc}); "
            "chunked losses need a transformers causal LM (set train.loss.chunked: false)"
        ) from None
    states = getattr(out, "hidden_states", None)
    if not states or states[-1] is None:
        raise ChunkedLossError(f"{type(model).__name__} returned no hidden states; use the plain loss")
    return states[-1]


def lm_hidden_and_head(model: nn.Module, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, LMHead]:
    """Final hidden states and the head, read after the forward (FSDP2 leaves root weights gathered then)."""
    hidden = final_hidden_states(model, input_ids, **kwargs)
    return hidden, lm_head_of(model)
