"""Where the parts of a causal LM are: its repeated decoder blocks, and a weightless copy; and
modules run with another forward for a while (:func:`forwards_replaced`).

One lookup for the decoder blocks, shared by activation checkpointing and FSDP (``train``),
GPTQ's block-by-block pass, the equalization folds, sensitivity groups and the GQA rewrite
(``optimize``), so every feature agrees on what a "block" is for every architecture.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, Iterator

import torch
from torch import nn


def _split_classes(model: nn.Module) -> set[str]:
    """HF's ``_no_split_modules`` (the decoder-layer class names), looking through wrappers
    (peft, FSDP, checkpointing) that keep the HF model a level or two down."""
    inner: Any = model
    for _ in range(4):
        names = getattr(inner, "_no_split_modules", None)
        if names:
            return set(names)
        inner = getattr(inner, "model", None) or getattr(inner, "base_model", None)
        if inner is None or inner is model:
            break
    return set()


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the repeated decoder blocks, in model order; ``[]`` if none.

    The blocks are the modules of HF's ``_no_split_modules`` classes (outermost matches of the
    most repeated class: BERT also lists its embeddings), else the items of the longest
    ``nn.ModuleList`` (GPT-2's ``h``, Llama's ``layers``)."""
    classes = _split_classes(model)
    if classes:
        found: list[tuple[str, nn.Module]] = []
        for name, mod in model.named_modules():
            if type(mod).__name__ in classes and not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, mod))
        if found:
            counts = Counter(type(m).__name__ for _, m in found)
            top = max(counts.values())
            return [(n, m) for n, m in found if counts[type(m).__name__] == top]
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda t: len(t[1]))  # the first of the longest
    return [(f"{name}.{i}" if name else str(i), b) for i, b in enumerate(blocks)]


def block_of(name: str, blocks: list[str]) -> str | None:
    """The block (one of ``blocks``' names) that module ``name`` lies in, or None."""
    for b in blocks:
        if name.startswith(b + "."):
            return b
    return None


def meta_model(config: Any) -> nn.Module:
    """The causal LM a transformers ``config`` describes, built on the meta device: every module,
    name and shape, no weights (milliseconds even for large models). For checks that must run
    before any weights are loaded (``optimize validate``, pre-flight)."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a weightless build has nothing to warn the user about
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    finally:
        hf_logging.set_verbosity(prev)


@contextlib.contextmanager
def forwards_replaced(mods: list[nn.Module], make: Callable[[int, nn.Module], Callable]) -> Iterator[None]:
    """Inside the block module ``i`` of ``mods`` runs ``make(i, mod)`` as its forward (its hooks
    still run: they live in ``__call__``); on any exit its own instance forward (a wrapper's) or
    its class's forward is back. GPTQ's block chain passes blocks through with it, and the
    float64 calibration gives Linears float32 products."""
    saved = [mod.__dict__.get("forward") for mod in mods]  # a wrapper's own forward, if any
    for i, mod in enumerate(mods):
        mod.forward = make(i, mod)
    try:
        yield
    finally:
        for mod, old in zip(mods, saved):
            if old is None:
                mod.__dict__.pop("forward", None)  # the class's forward is back
            else:
                mod.forward = old
