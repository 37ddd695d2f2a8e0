"""Exact orthogonal rotations folded into the weights (QuaRot / SpinQuant's R1 and R2).

4-bit weights and int8 activations lose most where a few channels carry outliers: the group's
or the token's scale follows the outlier and every other value is rounded coarsely. Rotating
the space those channels live in by an orthogonal matrix ``Q`` spreads each outlier over all
channels, and because ``Q Q^T = I`` the rotation folds into the weights on both sides of the
activation: the model computes the same function and nothing is added at run time.

- **R1, the residual stream** (width ``hidden``). RMSNorm commutes with a rotation once its
  per-channel weight is folded into the linears that read it (``rms(x Q) = rms(x)``), so:
  every norm's weight ``c + w`` is folded into its readers' columns and set to the identity;
  the embedding's rows become ``E Q``; every reader of the stream (q/k/v, gate/up, lm_head)
  ``W Q``; every writer (o_proj, down_proj, and their biases) ``Q^T W``.
- **R2, per attention head** (width ``head_dim``). Attention mixes V rows with convex weights,
  so rotating each KV head's values by ``H`` (v_proj rows ``H^T W_v``) and each query head's
  slice of o_proj's columns by the same ``H`` (``W_o H``) cancels inside every head.

The matrix is a randomized Hadamard matrix (``H diag(±1) / sqrt(n)``, seeded; torchao's
``torchao.prototype.spinquant`` tables cover ``2^k`` and ``{12, 20, 28, 36, 40, 44, 52, 60,
108, 140, 156, 172} * 2^k``) and a seeded random orthogonal matrix (QR of a Gaussian) where the
width has no Hadamard matrix there, or where asked.

What cannot be exact is refused (:class:`RotateRefused`), before any weight changes:
LayerNorm (mean-centering does not commute with a rotation; run the ``rmsnorm`` stage first),
norms applied to a block's *output* before the residual add (Gemma2/Gemma3's sandwich norms:
R1 is refused there, R2 still applies), a normalised ``v`` (``v_norm``), and architectures
without a fold layout (:mod:`optimize.quant.fold_layouts`).

**Tied embeddings.** The lm_head reads the *final norm's* output, so it takes that norm's
weight folded in, and the embedding does not: ``E diag(g) Q`` against ``E Q``. A tie can only
survive R1 when ``g`` is all ones (it is kept then); otherwise the lm_head gets its own weight
(``untie``, reported with the bytes it adds), or the stage refuses (``tied: refuse``).
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from optimize.quant.equalize import FoldGroup, fold_groups
from optimize.quant.fold_layouts import FoldRefused, layout_for, norm_offset
from train.model_parts import decoder_blocks

MatrixKind = Literal["hadamard", "random"]
TiedPolicy = Literal["untie", "refuse"]


class RotateRefused(FoldRefused):
    """A rotation cannot be folded exactly into this model; the message says why."""


# ---------------------------------------------------------------- matrices

def hadamard_available(n: int) -> bool:
    """True if torchao's tables give a Hadamard matrix of size ``n``."""
    return _hadamard_factor(n) is not None


def _hadamard_factor(n: int) -> int | None:
    """``K`` with ``n = K * 2^k`` and a stored Hadamard matrix of size ``K`` (1: a power of two)."""
    if n <= 0:
        return None
    for k in (172, 156, 140, 108, 60, 52, 44, 40, 36, 28, 20, 12, 1):
        if n % k == 0:
            m = n // k
            if m & (m - 1) == 0:
                return k
    return None


def _hadamard_utils():
    # torchao prints a NOTE about fast_hadamard_transform on import: not the user's business
    with contextlib.redirect_stdout(io.StringIO()):
        from torchao.prototype.spinquant import hadamard_utils
    return hadamard_utils


def rotation_matrix(n: int, kind: MatrixKind, seed: int) -> tuple[torch.Tensor, str]:
    """An ``n x n`` orthogonal matrix in float64 and how it was made (for the report)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "hadamard" and hadamard_available(n):
        hu = _hadamard_utils()
        k = _hadamard_factor(n)
        had_k = hu.get_hadK(n)[0] if k != 1 else torch.ones(1, 1)
        signs = (torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1)
        # torchao divides by a float32 sqrt(n); its entries are +-1 before that, so take them
        # back exactly and normalise in float64
        q = torch.round(hu.matmul_hadU_slow(torch.diag(signs), had_k.double(), k) * math.sqrt(n)) / math.sqrt(n)
        how = f"randomized Hadamard ({n} = {k} x {n // k})" if k != 1 else f"randomized Hadamard ({n} = 2^{int(math.log2(n))})"
    else:
        a = torch.randn(n, n, generator=gen, dtype=torch.float64)
        q, r = torch.linalg.qr(a)
        q = q * torch.sign(torch.diagonal(r)).view(1, -1)  # a uniformly random orthogonal matrix
        how = "random orthogonal (QR of a seeded Gaussian)" + (
            "" if kind == "random" else f"; {n} has no Hadamard matrix in torchao's tables")
    err = float((q @ q.T - torch.eye(n, dtype=torch.float64)).abs().max())
    if err > 1e-9:
        raise RuntimeError(f"rotation matrix of size {n} is not orthogonal (max |QQ^T - I| = {err:.3g})")
    return q.double(), how


# ---------------------------------------------------------------- the plan (what is rotated)

@dataclass
class RotationPlan:
    """The modules a rotation touches, found from the architecture before anything changes."""

    embedding: str
    final_norm: str
    lm_head: str
    #: norm -> the linears reading its output (the stream's readers, per block)
    norm_readers: list[tuple[str, list[str]]] = field(default_factory=list)
    #: linears writing into the residual stream (o_proj, down_proj)
    writers: list[str] = field(default_factory=list)
    #: R2: (v source, v rows or None, o_proj, head_dim, kv heads)
    heads: list[tuple[str, tuple[int, int] | None, str, int, int]] = field(default_factory=list)
    hidden: int = 0
    head_dim: int = 0
    r1_refused: str | None = None


def _named(model: nn.Module, module: nn.Module | None) -> str | None:
    for name, mod in model.named_modules():
        if mod is module:
            return name
    return None


def _final_norm(model: nn.Module) -> str | None:
    """The norm between the last block and the lm_head (``model.norm`` in HF decoders)."""
    base = getattr(model, "model", None)
    for inner in (base, getattr(base, "language_model", None)):
        if inner is not None and isinstance(getattr(inner, "norm", None), nn.Module):
            return _named(model, inner.norm)
    return None


def plan_rotation(model: nn.Module, r1: bool = True, r2: bool = True) -> RotationPlan:
    """Where R1/R2 go in ``model`` (weightless meta models too), or RotateRefused."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise RotateRefused(f"{type(model).__name__} has no transformers config; rotations need a known architecture")
    try:
        lay = layout_for(cfg)
        groups = fold_groups(model, ("qkv", "gate_up", "down", "o"))
    except FoldRefused as exc:
        raise RotateRefused(str(exc)) from None
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    plan = RotationPlan(embedding=_named(model, emb) or "?", final_norm=_final_norm(model) or "?",
                        lm_head=_named(model, head) or "?")
    by_kind: dict[str, list[FoldGroup]] = {}
    for g in groups:
        by_kind.setdefault(g.kind, []).append(g)
    plan.norm_readers = [(g.source, list(g.linears)) for g in by_kind.get("qkv", []) + by_kind.get("gate_up", [])]
    plan.writers = [g.linears[0] for g in by_kind.get("o", [])] + [g.linears[0] for g in by_kind.get("down", [])]
    for g in by_kind.get("o", []):
        kv_heads = (g.rows[1] - g.rows[0] if g.rows else model.get_submodule(g.source).out_features) // g.head_dim
        plan.heads.append((g.source, g.rows, g.linears[0], g.head_dim, kv_heads))
        plan.head_dim = g.head_dim
    if isinstance(emb, nn.Embedding):
        plan.hidden = emb.embedding_dim

    if r1:
        routers = [f for g in groups for f in g.fixed]
        why = (f"a mixture of experts' router ({routers[0]}) reads the residual stream, and R1 folds into "
               "Linears only" if routers else _r1_problem(model, plan, lay))
        if why:
            plan.r1_refused = why
    if r2 and not plan.heads:
        raise RotateRefused("no attention heads found for R2 (v_proj -> o_proj)")
    return plan


def _r1_problem(model: nn.Module, plan: RotationPlan, lay) -> str | None:
    """Why R1 cannot be exact on this model, or None."""
    if not isinstance(model.get_input_embeddings(), nn.Embedding):
        return "the input embedding is not an nn.Embedding"
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        return "the output head is not an nn.Linear"
    if plan.final_norm == "?":
        return "no final norm (model.norm) found before the lm_head"
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "the lm_head has a bias"
    norms = [n for n, _ in plan.norm_readers] + [plan.final_norm]
    for name in norms:
        mod = model.get_submodule(name)
        if isinstance(mod, nn.LayerNorm):
            return (f"{name} is a LayerNorm: its mean-centering does not commute with a rotation "
                    "(run the rmsnorm stage first, which rewrites LayerNorm to RMSNorm exactly)")
        if getattr(mod, "bias", None) is not None:
            return f"{name} has a bias, which a rotation of the stream would have to carry"
    # a norm on a block's output before the residual add (Gemma2/3 sandwich norms) rescales the
    # stream per channel after the writers: nothing folds it
    for bname, block in decoder_blocks(model):
        for attr in ("post_feedforward_layernorm",) + (
                ("post_attention_layernorm",) if lay.mlp_norm != "post_attention_layernorm" else ()):
            if isinstance(getattr(block, attr, None), nn.Module):
                return (f"{bname}.{attr} normalises the block's output before the residual add "
                        "(sandwich norms), which no rotation of the stream commutes with")
    # any other module reading the embedding output or the stream (positional tables, per-layer
    # inputs) would be missed: the exactness probe proves the result either way
    return None


# ---------------------------------------------------------------- folding

@dataclass
class RotateResult:
    r1: str | None = None  # how the R1 matrix was made, None when not applied
    r2: str | None = None
    untied: bool = False
    untied_bytes: int = 0
    tie_kept: bool = False
    norms_folded: int = 0
    linears_rotated: int = 0


def _cols(lin: nn.Linear, m: torch.Tensor) -> None:
    """``W <- W m`` (the linear's input is rotated by ``m``)."""
    w = lin.weight
    w.copy_((w.double() @ m).to(w.dtype))


def _rows(lin: nn.Linear, m: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
    """``W[lo:hi] <- m^T W[lo:hi]``, ``b <- m^T b`` (the linear's output is rotated by ``m``)."""
    hi = lin.out_features if hi is None else hi
    w = lin.weight[lo:hi]
    w.copy_((m.T @ w.double()).to(w.dtype))
    if lin.bias is not None:
        b = lin.bias[lo:hi]
        b.copy_((b.double() @ m).to(b.dtype))


def _fold_norm(model: nn.Module, norm_name: str, readers: list[nn.Linear]) -> None:
    """Fold the norm's ``c + w`` into its readers' columns; the norm becomes the identity scale."""
    norm = model.get_submodule(norm_name)
    c = norm_offset(norm, norm_name)
    scale = c + norm.weight.detach().double()
    for lin in readers:
        lin.weight.copy_((lin.weight.double() * scale.view(1, -1)).to(lin.weight.dtype))
    norm.weight.fill_(1.0 - c)


@torch.no_grad()
def rotate_model(model: nn.Module, plan: RotationPlan, *, r1: bool, r2: bool, matrix: MatrixKind, seed: int,
                 tied: TiedPolicy = "untie") -> RotateResult:
    """Fold R1 and/or R2 into ``model`` in place (see the module docstring)."""
    res = RotateResult()
    if r1 and plan.r1_refused:
        raise RotateRefused(f"R1 (residual stream) cannot be exact here: {plan.r1_refused}; set r1: false to apply R2 only")
    if r1:
        emb = model.get_submodule(plan.embedding)
        head = model.get_submodule(plan.lm_head)
        final = model.get_submodule(plan.final_norm)
        c = norm_offset(final, plan.final_norm)
        identity_final = bool(((c + final.weight.detach().double()) == 1.0).all())
        was_tied = head.weight is emb.weight
        if was_tied and not identity_final:
            if tied == "refuse":
                raise RotateRefused(
                    "the embedding is tied to the lm_head and the final norm's weight is not all ones: R1 folds that "
                    "weight into the lm_head only, so the tie cannot be kept (set tied: untie to give the lm_head "
                    "its own weight, or r1: false)")
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
            for cfg in {id(x): x for x in (model.config, _text_config(model.config))}.values():
                cfg.tie_word_embeddings = False
            res.untied = True
            res.untied_bytes = head.weight.numel() * head.weight.element_size()
        res.tie_kept = was_tied and not res.untied
        q, res.r1 = rotation_matrix(plan.hidden, matrix, seed)
        for norm_name, readers in plan.norm_readers:
            _fold_norm(model, norm_name, [model.get_submodule(r) for r in readers])
            res.norms_folded += 1
        if not res.tie_kept:
            _fold_norm(model, plan.final_norm, [head])
        else:
            final.weight.fill_(1.0 - c)  # all ones already in effect
        res.norms_folded += 1
        e = emb.weight
        e.copy_((e.double() @ q).to(e.dtype))
        readers = [model.get_submodule(r) for _, rs in plan.norm_readers for r in rs]
        if not res.tie_kept:
            readers.append(head)
        for lin in readers:
            _cols(lin, q)
        for w in plan.writers:
            _rows(model.get_submodule(w), q)
        res.linears_rotated += len(readers) + len(plan.writers)
    if r2:
        h, res.r2 = rotation_matrix(plan.head_dim, matrix, seed + 1)
        for v_src, v_rows, o_name, hd, kv_heads in plan.heads:
            v = model.get_submodule(v_src)
            lo = v_rows[0] if v_rows else 0
            for k in range(kv_heads):
                _rows(v, h, lo + k * hd, lo + (k + 1) * hd)
            o = model.get_submodule(o_name)
            blocks = o.in_features // hd
            ow = o.weight
            ow.copy_((ow.double().view(ow.shape[0], blocks, hd) @ h).view_as(ow).to(ow.dtype))
            res.linears_rotated += 2
    return res


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config
