"""Rewrites that keep a decoder layer inside one XNNPACK subgraph.

After attention and the KV cache go through ExecuTorch's LLM ops, what still falls back to the
portable kernels (and splits each layer into several delegate calls) comes from these places:

* **reshapes with a symbolic length.** transformers writes ``q.view(*input_shape, -1, head_dim)``:
  under a dynamic sequence length the exported shape is ``[1, s, -1, D]``, and XNNPACK's
  ``static_reshape`` takes at most one inferred dim and no symbolic one. The same holds for
  ``unsqueeze`` (no XNNPACK op at all). :func:`static_reshapes` rewrites each to a ``view`` whose
  only unknown is the ``-1`` in place of the sequence length, which XNNPACK runs.
* **RoPE's** ``rotate_half`` slices the last dim and concatenates (``cat(-x[..., D/2:], x[..., :D/2])``):
  with :mod:`export.executorch.xnnpack_slices` those static-dim slices run inside XNNPACK as they are. (An
  earlier version computed it as a linear against a constant signed permutation; the slices are
  exact by definition and prefill-128 of SmolLM2 8da4w took 74-75 ms instead of 80-83.)
* **RMSNorm's** ``mean`` over the last dim: :class:`XnnpackRMSNorm` takes it as a linear against a
  constant ``1/dim`` row, which XNNPACK runs (:func:`swap_rms_norms` swaps only norms it reproduces).
* **tanh-GELU**: XNNPACK's GELU computes the erf form; :class:`TanhGELU` spells the tanh form out.
* **splits, aliases and empty concatenations** (Phi-3's ``qkv`` and ``gate_up.chunk(2)``, GPT-2's
  ``c_attn.split``, a full-width "partial" rotary's ``cat([rotated, x[..., D:]])``): none of them
  has an XNNPACK op. :func:`split_as_slices` turns each split output into a slice along its static
  dim (which :mod:`export.executorch.xnnpack_slices` delegates), drops aliases and zero-width concat inputs.

The reshapes and the split rewrite leave the numbers unchanged; ``tests/export/executorch/test_delegable.py``
checks that.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: name of :class:`XnnpackRMSNorm`'s ``1/dim`` row (its mean of squares is a linear); export/precision.py
#: leaves that linear out of the mix
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


_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default)


def _split_sizes(node: torch.fx.Node, extent: int) -> list[int] | None:
    if node.target is torch.ops.aten.split_with_sizes.default:
        sizes = list(node.args[1])
        return sizes if all(isinstance(s, int) for s in sizes) else None
    n = node.args[1]
    if not isinstance(n, int) or n < 1:
        return None
    step = n if node.target is torch.ops.aten.split.Tensor else -(-extent // n)  # chunk: ceil(extent / n)
    return [min(step, extent - i) for i in range(0, extent, step)]


def split_as_slices(ep: torch.export.ExportedProgram) -> int:
    """Rewrite splits along a static dim as slices, aliases as their input, and drop zero-width inputs
    of a concatenation (a lone survivor replaces the cat). Values are unchanged. Returns how many
    nodes changed."""
    import operator

    graph = ep.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.alias.default:
            node.replace_all_uses_with(node.args[0])
            changed += 1
        elif node.target in _SPLITS:
            src = node.args[0]
            val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor):
                continue
            dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % val.dim()
            extent = val.shape[dim]
            sizes = _split_sizes(node, extent) if isinstance(extent, int) else None
            users = list(node.users)
            if sizes is None or not all(u.target is operator.getitem for u in users):
                continue
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            for u in users:
                i = u.args[1]
                with graph.inserting_before(u):
                    sl = graph.call_function(torch.ops.aten.slice.Tensor, (src, dim, starts[i], starts[i] + sizes[i]))
                sl.meta = dict(u.meta)
                u.replace_all_uses_with(sl)
            changed += 1
        elif node.target is torch.ops.aten.cat.default:
            parts = list(node.args[0])
            dim = node.args[1] if len(node.args) > 1 else 0
            keep = [p for p in parts if not (isinstance(p, torch.fx.Node) and isinstance(p.meta.get("val"), torch.Tensor)
                                              and p.meta["val"].shape[dim] == 0)]
            if len(keep) == len(parts) or not keep:
                continue
            if len(keep) == 1:
                node.replace_all_uses_with(keep[0])
            else:
                node.args = (keep, *node.args[1:])
            changed += 1
    if changed:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return changed


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
