"""Rewrites that keep a decoder layer inside one XNNPACK subgraph.

After attention and the KV cache go through ExecuTorch's LLM ops, what still falls back to the
portable kernels (and splits each layer into several delegate calls) comes from these places:

* **reshapes with a symbolic length.** transformers writes ``q.view(*input_shape, -1, head_dim)``:
  under a dynamic sequence length the exported shape is ``[1, s, -1, D]``, and XNNPACK's
  ``static_reshape`` takes at most one inferred dim and no symbolic one. The same holds for
  ``unsqueeze`` (no XNNPACK op at all). :func:`static_reshapes` rewrites each to a ``view`` whose
  only unknown is the ``-1`` in place of the sequence length, which XNNPACK runs.
* **RoPE's** ``rotate_half`` slices the last dim (``cat(-x[..., D/2:], x[..., :D/2])``); XNNPACK
  slices only static shapes. :func:`rotate_half_as_linear` computes it as ``x @ R^T`` with a
  constant signed permutation ``R`` (a fully-connected op XNNPACK runs under dynamic shapes).
  Every output element is one input element times +-1 plus exact zeros, so it is bit-exact.
* **RMSNorm's** ``mean`` over the last dim: :class:`XnnpackRMSNorm` takes it as a linear against a
  constant ``1/dim`` row, which XNNPACK runs (:func:`swap_rms_norms` swaps only norms it reproduces).
* **tanh-GELU**: XNNPACK's GELU computes the erf form; :class:`TanhGELU` spells the tanh form out.

The reshapes and the rotation leave the numbers unchanged; ``tests/export/test_executorch_delegable.py``
checks that.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Iterator

import torch
from torch import nn

#: name prefix of the rotation buffers; export/linear_schemes.py leaves these linears out of the mix
ROPE_BUFFER_PREFIX = "_rope_rotation_"
#: name of :class:`XnnpackRMSNorm`'s ``1/dim`` row (its mean of squares is a linear); left out of the mix too
NORM_MEAN_BUFFER = "_rms_mean_row"
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


# ---------------------------------------------------------------------------------------------
# RMSNorm


class XnnpackRMSNorm(nn.Module):
    """RMSNorm in ops XNNPACK delegates, so the norm does not split the delegated graph.

    The mean of squares over the last dim is a fully-connected op against a constant
    ``[1, dim]`` row of ``1/dim`` (:data:`NORM_MEAN_BUFFER`): XNNPACK runs that under a dynamic
    sequence length on any ``[..., dim]`` input, where its ``mean`` reduces only the inner dims of a
    4-D tensor and would need a view to 4-D and a transpose on each side (SmolLM2 prefill-128:
    3.5 ms of means and 2 ms of transposes). ``weight`` is the effective scale (Gemma's ``1 + w``
    folded in).
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().float(), requires_grad=False)
        self.eps = float(eps)
        dim = int(weight.shape[-1])
        self.register_buffer(NORM_MEAN_BUFFER, torch.full((1, dim), 1.0 / dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        ms = torch.nn.functional.linear(h * h, getattr(self, NORM_MEAN_BUFFER))  # [..., 1]
        return (h * torch.rsqrt(ms + self.eps) * self.weight).to(dtype)


def _norm_eps(m: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, name, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def swap_rms_norms(model: nn.Module) -> dict[str, int]:
    """Replace every RMSNorm whose output a :class:`XnnpackRMSNorm` reproduces (checked on random
    input, as ``w`` or Gemma's ``1 + w``); leave the others. Returns counts for the report."""
    swapped = kept = 0
    g = torch.Generator().manual_seed(0)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not type(child).__name__.endswith("RMSNorm") or isinstance(child, XnnpackRMSNorm):
                continue
            w = getattr(child, "weight", None)
            eps = _norm_eps(child)
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None:
                kept += 1
                continue
            x = torch.randn(2, 3, w.shape[0], generator=g, dtype=w.dtype if w.is_floating_point() else torch.float32)
            with torch.no_grad():
                ref = child(x).float()
                for cand in (w, 1.0 + w.float()):
                    new = XnnpackRMSNorm(cand, eps)
                    if torch.allclose(new(x).float(), ref, rtol=1e-4, atol=1e-5):
                        setattr(parent, name, new)
                        swapped += 1
                        break
                else:
                    kept += 1
    return {"swapped": swapped, "kept": kept}


class TanhGELU(nn.Module):
    """``gelu(x, approximate="tanh")`` spelled out in ops XNNPACK runs exactly. XNNPACK's GELU
    ignores ``approximate`` (executorch 1.5.1) and computes the erf form, which moves a Gemma
    model's logits by ~1e-3; the formula keeps the .pte on eager's numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def swap_tanh_gelus(model: nn.Module) -> int:
    """Replace activation modules that compute tanh-approximated GELU (checked on random input)."""
    swapped = 0
    x = torch.linspace(-6, 6, 97)
    want = torch.nn.functional.gelu(x, approximate="tanh")
    erf = torch.nn.functional.gelu(x)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if "GELU" not in type(child).__name__.upper() or isinstance(child, TanhGELU) or list(child.parameters()):
                continue
            with torch.no_grad():
                got = child(x)
            if torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, erf, atol=1e-6):
                setattr(parent, name, TanhGELU())
                swapped += 1
    return swapped
