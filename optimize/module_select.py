"""Choosing modules by name: fnmatch patterns plus the ``embeddings`` / ``lm_head`` shorthands.

Quantization stages (and later mixed-precision search) select layers by their dotted names
(``model.layers.3.mlp.down_proj``). Architectures name their embedding and output projection
differently (``lm_head``, ``embed_out``, ``output``), so two shorthands resolve through the
model's own ``get_input_embeddings`` / ``get_output_embeddings`` instead of a fixed name.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable

import torch
from torch import nn

#: shorthand -> what it stands for (resolved per model by :func:`resolve_patterns`)
SHORTHANDS = {
    "embeddings": "the input token embedding table (model.get_input_embeddings())",
    "lm_head": "the output projection to the vocabulary (model.get_output_embeddings())",
}


def module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    """Dotted name of ``module`` inside ``model``, or None if it is not a submodule."""
    if module is None:
        return None
    for name, mod in model.named_modules():
        if mod is module:
            return name
    return None


def _getter(model: nn.Module, attr: str) -> nn.Module | None:
    fn = getattr(model, attr, None)
    if fn is None:
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError):
        return None


def resolve_patterns(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Expand the shorthands into the model's real module names; other patterns pass through.

    A shorthand the model lacks (no output embedding, say) resolves to nothing rather than
    an error: ``lm_head`` in a default list must not break models without one.
    """
    out: list[str] = []
    for pat in patterns:
        if pat == "embeddings":
            name = module_name(model, _getter(model, "get_input_embeddings"))
        elif pat == "lm_head":
            name = module_name(model, _getter(model, "get_output_embeddings"))
            if name is None and isinstance(getattr(model, "lm_head", None), nn.Module):
                name = "lm_head"
        else:
            out.append(pat)
            continue
        if name:
            out.append(name)
    return out


def matches(name: str, patterns: Iterable[str]) -> bool:
    """True if the dotted ``name`` matches any fnmatch pattern (``*`` also crosses dots).

    A pattern also matches every module below a matching name, so ``model.layers.0``
    selects that whole block.
    """
    for pat in patterns:
        if fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(name, pat + ".*"):
            return True
    return False


def select_modules(
    model: nn.Module,
    kinds: tuple[type, ...] | type,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> tuple[list[str], list[str]]:
    """Names of the ``kinds`` modules to transform and of those left alone.

    ``include`` (None = all) and ``exclude`` are patterns or shorthands; exclude wins.
    Returns ``(selected, kept)`` in model order.
    """
    inc = resolve_patterns(model, include) if include is not None else None
    exc = resolve_patterns(model, exclude)
    selected, kept = [], []
    for name, mod in model.named_modules():
        if not name or not isinstance(mod, kinds):
            continue
        if (inc is None or matches(name, inc)) and not matches(name, exc):
            selected.append(name)
        else:
            kept.append(name)
    return selected, kept


def unmatched_patterns(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Patterns (after shorthand expansion) that match no module name at all: likely typos."""
    names = [n for n, _ in model.named_modules() if n]
    bad = []
    for pat in patterns:
        if pat in SHORTHANDS:
            continue
        if not any(matches(n, [pat]) for n in names):
            bad.append(pat)
    return bad


def is_tied(a: nn.Module | None, b: nn.Module | None) -> bool:
    """True if two modules share one weight tensor (tied embeddings)."""
    wa, wb = getattr(a, "weight", None), getattr(b, "weight", None)
    return isinstance(wa, torch.Tensor) and wa is wb
