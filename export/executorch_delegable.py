"""Rewrites that keep a decoder layer inside one XNNPACK subgraph.

After attention and the KV cache go through ExecuTorch's LLM ops, what still falls back to the
portable kernels (and splits each layer into several delegate calls) comes from two places:

* **reshapes with a symbolic length.** transformers writes ``q.view(*input_shape, -1, head_dim)``:
  under a dynamic sequence length the exported shape is ``[1, s, -1, D]``, and XNNPACK's
  ``static_reshape`` takes at most one inferred dim and no symbolic one. The same holds for
  ``unsqueeze`` (no XNNPACK op at all). :func:`static_reshapes` rewrites each to a ``view`` whose
  only unknown is the ``-1`` in place of the sequence length, which XNNPACK runs.
* **RoPE's** ``rotate_half`` slices the last dim (``cat(-x[..., D/2:], x[..., :D/2])``); XNNPACK
  slices only static shapes. :func:`rotate_half_as_linear` computes it as ``x @ R^T`` with a
  constant signed permutation ``R`` (a fully-connected op XNNPACK runs under dynamic shapes).
  Every output element is one input element times +-1 plus exact zeros, so it is bit-exact.

Both leave the numbers unchanged; ``tests/export/test_executorch_delegable.py`` checks that.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import nn

#: name prefix of the rotation buffers; export/linear_schemes.py leaves these linears out of the mix
ROPE_BUFFER_PREFIX = "_rope_rotation_"
# ``reshape`` is already decomposed into ``view`` by export; ``_unsafe_view`` is a view of a fresh copy
_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.unsqueeze.default)


def static_reshapes(ep: torch.export.ExportedProgram) -> int:
    """Rewrite reshapes and unsqueezes whose output has exactly one symbolic dim into a ``view``
    with that dim as ``-1`` and every other dim concrete. Returns how many nodes changed."""
    changed = 0
    graph = ep.graph_module.graph
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _RESHAPES:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        out = list(val.shape)
        symbolic = [i for i, d in enumerate(out) if not isinstance(d, int)]
        if len(symbolic) != 1:  # fully static shapes already lower; two unknowns cannot be one -1
            continue
        shape = [-1 if i == symbolic[0] else int(d) for i, d in enumerate(out)]
        args = (node.args[0], shape)
        if node.target == torch.ops.aten.view.default and tuple(node.args) == args:
            continue
        node.target, node.args = torch.ops.aten.view.default, args
        changed += 1
    if changed:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return changed


def rotation_matrix(dim: int) -> torch.Tensor:
    """``R`` with ``x @ R.T == rotate_half(x)`` for a last dim of ``dim`` (even)."""
    if dim % 2:
        raise ValueError(f"rotate_half needs an even dim, got {dim}")
    half = dim // 2
    r = torch.zeros(dim, dim)
    idx = torch.arange(half)
    r[idx, idx + half] = -1.0  # out[i] = -x[i + D/2]
    r[idx + half, idx] = 1.0  # out[i + D/2] = x[i]
    return r


def _rotary_dims(config) -> set[int]:
    """Last-dim sizes ``rotate_half`` sees: the head dim, or its rotary part (partial RoPE)."""
    from export.executorch_llm import _text_config

    cfg = _text_config(config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dims = {int(head_dim)}
    factor = getattr(cfg, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if factor:
        dims.add(int(head_dim * float(factor)))
    return {d for d in dims if d > 0 and d % 2 == 0}


@contextlib.contextmanager
def rotate_half_as_linear(model: nn.Module, owner: nn.Module) -> Iterator[int]:
    """While tracing, make the model's ``rotate_half`` a linear with a constant rotation.

    transformers' modeling files each define a module-level ``rotate_half`` that
    ``apply_rotary_pos_emb`` looks up at call time; it is replaced in the modeling modules of
    ``model``'s classes and restored on exit. The matrices are non-persistent buffers of
    ``owner`` (the module being exported), so the export lifts them as constants. Yields how
    many modeling modules were patched (0: the model has no ``rotate_half``, nothing changes).
    """
    dims = _rotary_dims(model.config)
    mats = {}
    for d in sorted(dims):
        name = f"{ROPE_BUFFER_PREFIX}{d}"
        if not hasattr(owner, name):
            owner.register_buffer(name, rotation_matrix(d), persistent=False)
        mats[d] = name
    modules = {type(m).__module__ for m in model.modules()}
    patched = []
    for mod_name in sorted(modules):
        mod = sys.modules.get(mod_name)
        orig = getattr(mod, "rotate_half", None)
        if mod is None or not callable(orig):
            continue

        def linear_rotate_half(x, _orig=orig):
            name = mats.get(int(x.shape[-1]))
            if name is None:
                return _orig(x)
            r = getattr(owner, name)
            return torch.nn.functional.linear(x, r if r.dtype == x.dtype else r.to(x.dtype))

        mod.rotate_half = linear_rotate_half
        patched.append((mod, orig))
    try:
        yield len(patched)
    finally:
        for mod, orig in patched:
            mod.rotate_half = orig
