"""Chunked LM losses: cross-entropy and KL-to-teacher without full ``[tokens, vocab]`` logits.

Why: at vocab 49k and 4k tokens the fp32 logits alone are 0.8 GB, and a plain
``cross_entropy(lm_head(h).float())`` keeps several such tensors alive (logits, their fp32
copy, log-softmax, its gradient). As in Liger's fused linear cross-entropy, a custom
autograd function runs the final hidden states through the output head one chunk of tokens
at a time and computes the gradients w.r.t. the hidden states and the head weight in the
same pass, so only one chunk's logits ever live and nothing of size ``vocab`` is saved for
backward. The result equals the plain loss (and its gradients) to float tolerance.

Public API (``optimize.losses`` and the distill stage use the KL primitive; the head and the
hidden states come from :mod:`train.lm_head`):

- :func:`chunked_cross_entropy`, :func:`chunked_kl_to_teacher`: the losses;
- :func:`chunked_lm_loss`: a training loss (``train.step``) built on them;
- :func:`check_head_matches_logits`: refuses a model whose logits the head does not explain.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from train.lm_head import ChunkedLossError, LMHead, head_loss

# --------------------------------------------------------------------------- the math


def _as_head(head: LMHead | torch.Tensor) -> LMHead:
    return head if isinstance(head, LMHead) else LMHead(head)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype the plain path would use: autocast's if active, else the promoted input dtype."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _Head:
    """One head's per-chunk logits (fp32) and the chain rule back through scale and softcap."""

    def __init__(self, head: LMHead, dtype: torch.dtype):
        self.w = head.weight.to(dtype)
        self.b = head.bias
        self.scale, self.cap, self.dtype = head.scale, head.softcap, dtype

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        z = (h.to(self.dtype) @ self.w.t()).float()
        if self.b is not None:
            z += self.b.float()
        if self.scale != 1.0:
            z *= self.scale
        if not self.cap:
            return z, None
        t = torch.tanh(z / self.cap)
        return t * self.cap, t

    def back(self, g: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """d loss / d (h @ W.T + b) from d loss / d logits (in place on ``g``)."""
        if t is not None:
            g *= 1 - t * t
        if self.scale != 1.0:
            g *= self.scale
        return g


class _Grads:
    """Gradient buffers for hidden, weight and bias, filled chunk by chunk."""

    def __init__(self, hidden, weight, bias, need: tuple[bool, bool, bool]):
        self.need = need
        self.h = torch.empty_like(hidden) if need[0] else None
        self.w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
        self.b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need[2] else None

    def add(self, sl: slice, g: torch.Tensor, h: torch.Tensor, head: _Head) -> None:
        gc = g.to(head.dtype)
        if self.h is not None:
            self.h[sl] = (gc @ head.w).to(self.h.dtype)
        if self.w is not None:
            if gc.dtype == torch.float32:
                self.w.addmm_(gc.t(), h.float())
            else:
                self.w += (gc.t() @ h.to(head.dtype)).float()
        if self.b is not None:
            self.b += g.sum(0)

    def scaled(self, grad_out: torch.Tensor, dtypes: tuple) -> tuple:
        """The gradients times ``grad_out``, in place: backward runs once, and no second copy of the
        ``[vocab, hidden]`` weight gradient is made."""
        if self.need is None:
            raise RuntimeError("chunked loss: backward through the same graph twice is not supported")
        out = tuple(None if g is None else g.mul_(grad_out).to(dt) for g, dt in zip((self.h, self.w, self.b), dtypes))
        self.h = self.w = self.b = self.need = None
        return out


def _needs(*tensors) -> tuple[bool, ...]:
    on = torch.is_grad_enabled()
    return tuple(bool(on and t is not None and t.requires_grad) for t in tensors)


def _ce_chunk(z: torch.Tensor, y: torch.Tensor, ignore_index: int, want_grad: bool):
    """Summed CE of one chunk; with ``want_grad`` also ``softmax - onehot`` (masked), computed in place on ``z``."""
    valid = y != ignore_index
    yc = torch.where(valid, y, 0)
    lse = torch.logsumexp(z, dim=-1)
    tgt = z.gather(1, yc[:, None]).squeeze(1)
    loss = ((lse - tgt) * valid).sum()
    if not want_grad:
        return loss, None
    g = z.sub_(lse[:, None]).exp_()
    g[torch.arange(g.shape[0], device=g.device), yc] -= 1.0
    g *= valid[:, None]
    return loss, g


def _ce_chunk_logit_grad(h, w, b, y, inv_n, scale: float, cap: float | None, ignore_index: int, want_grad: bool):
    """One chunk as a pure function, for ``torch.compile``: ``(summed CE, d mean CE / d (h @ w.T + b))``,
    the gradient in ``w``'s dtype. Same math as ``_Head.logits`` + ``_ce_chunk`` + ``_Head.back``,
    written without in-place ops so Inductor fuses logsumexp, softmax, the target subtraction, the
    scaling and the cast into one pass over ``[chunk, vocab]`` (eager makes several, in fp32)."""
    z = (h @ w.t()).float()
    if b is not None:
        z = z + b.float()
    if scale != 1.0:
        z = z * scale
    t = None
    if cap:
        t = torch.tanh(z / cap)
        z = t * cap
    valid = y != ignore_index
    yc = torch.where(valid, y, 0)
    lse = torch.logsumexp(z, dim=-1)
    loss = ((lse - z.gather(1, yc[:, None]).squeeze(1)) * valid).sum()
    if not want_grad:
        return loss, None
    target = torch.arange(z.shape[-1], device=z.device)[None, :] == yc[:, None]
    g = (torch.exp(z - lse[:, None]) - target.to(z.dtype)) * (valid.to(z.dtype) * inv_n)[:, None]
    if t is not None:
        g = g * (1 - t * t)
    if scale != 1.0:
        g = g * scale
    return loss, g.to(w.dtype)


_COMPILED: dict[str, Callable] = {}


def _compiled_chunk_fn() -> Callable:
    """The compiled per-chunk function, built on first use (no compile work at import)."""
    fn = _COMPILED.get("ce")
    if fn is None:
        fn = _COMPILED["ce"] = torch.compile(_ce_chunk_logit_grad)
    return fn


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, head: LMHead, dtype, chunk, ignore_index, need, compiled=False):
        n_valid = (labels != ignore_index).sum().clamp(min=1).float()
        grads = _Grads(hidden, weight, bias, need)
        hd = _Head(head, dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        want = any(need)
        with torch.autocast(hidden.device.type, enabled=False):
            if compiled:
                fn, inv_n = _compiled_chunk_fn(), 1.0 / n_valid
                for s in range(0, hidden.shape[0], chunk):
                    sl = slice(s, s + chunk)
                    hc = hidden[sl].to(dtype)
                    loss, g = fn(hc, hd.w, hd.b, labels[sl], inv_n, hd.scale, hd.cap, ignore_index, want)
                    total += loss
                    if g is not None:
                        grads.add(sl, g, hidden[sl], hd)
            else:
                for s in range(0, hidden.shape[0], chunk):
                    sl = slice(s, s + chunk)
                    z, t = hd.logits(hidden[sl])
                    loss, g = _ce_chunk(z, labels[sl], ignore_index, want)
                    total += loss
                    if g is not None:
                        grads.add(sl, hd.back(g.div_(n_valid), t), hidden[sl], hd)
        ctx.grads, ctx.dtypes = grads, (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw, gb = ctx.grads.scaled(grad_out, ctx.dtypes)
        return gh, gw, gb, None, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: LMHead | torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    compiled: bool = False,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``head(hidden)`` against ``labels``, ``chunk_size`` tokens at a time.

    ``hidden`` is ``[..., H]`` (final hidden states, after the last norm), ``labels`` the matching
    ``[...]`` ids (already shifted); ``head`` an :class:`LMHead` or a bare ``[V, H]`` weight.
    Equals ``F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())``; the logits are
    computed in fp32 per chunk (matmul in autocast's dtype when autocast is on). ``compiled`` runs
    each chunk through one ``torch.compile``d function (fused softmax gradient; the first call
    compiles, and each new chunk shape may once more).
    """
    head = _as_head(head)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden positions but {y.shape[0]} labels")
    need = _needs(hidden, head.weight, head.bias)
    dtype = _compute_dtype(hidden, head.weight)
    return _ChunkedCE.apply(h, head.weight, head.bias, y, head, dtype, chunk_size, ignore_index, need, compiled)


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher, s_head, t_head, labels, opts: dict, need):
        T, alpha, chunk, ignore = opts["temperature"], opts["alpha"], opts["chunk"], opts["ignore_index"]
        n = hidden.shape[0]
        n_valid = (labels != ignore).sum().clamp(min=1).float() if labels is not None else None
        grads = _Grads(hidden, weight, bias, need)
        hs = _Head(s_head, opts["dtype"])
        ht = _Head(t_head, opts["t_dtype"]) if t_head is not None else None
        kl_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        want = any(need)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                sl = slice(s, s + chunk)
                z, t = hs.logits(hidden[sl])
                zt = ht.logits(teacher[sl])[0] if ht is not None else teacher[sl].float()
                log_t = torch.log_softmax(zt / T, dim=-1)
                log_s = torch.log_softmax(z / T, dim=-1)
                p_t = log_t.exp()
                kl_sum += (p_t * (log_t - log_s)).sum()
                g = None
                if want:  # d(T^2 * KL / n) / dz = T * (p_s - p_t) / n
                    g = log_s.exp_().sub_(p_t).mul_((1 - alpha) * T / n)
                del log_t, log_s, p_t, zt
                if alpha > 0:
                    ce, gce = _ce_chunk(z, labels[sl], ignore, want)
                    ce_sum += ce
                    if gce is not None:
                        g.add_(gce, alpha=alpha / float(n_valid))
                if g is not None:
                    grads.add(sl, hs.back(g, t), hidden[sl], hs)
        ctx.grads, ctx.dtypes = grads, (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        loss = kl_sum * (T * T / n) * (1 - alpha)
        if alpha > 0:
            loss = loss + alpha * ce_sum / n_valid
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw, gb = ctx.grads.scaled(grad_out, ctx.dtypes)
        return gh, gw, gb, None, None, None, None, None, None


def chunked_kl_to_teacher(
    student_hidden: torch.Tensor,
    student_head: LMHead | torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: LMHead | torch.Tensor | None,
    *,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
    alpha: float = 0.0,
    chunk_size: int = 1024,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``(1 - alpha) * T^2 * KL(teacher || student) + alpha * CE(labels)``, chunk by chunk.

    KL is per token at temperature ``T`` and averaged over all tokens (``optimize.losses.
    kl_to_teacher``'s definition); CE averages over labels that are not ``ignore_index``.
    ``teacher_hidden`` are the teacher's final hidden states read through ``teacher_head``, or,
    with ``teacher_head=None``, the teacher's logits ``[..., V]`` themselves (sliced per chunk).
    Gradients flow to the student's hidden states and head only; the teacher is constant.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha > 0 and labels is None:
        raise ValueError("alpha > 0 mixes in cross-entropy and needs labels")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    s_head = _as_head(student_head)
    t_head = None if teacher_head is None else _as_head(teacher_head)
    h = student_hidden.reshape(-1, student_hidden.shape[-1])
    th = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    if th.shape[0] != h.shape[0]:
        raise ValueError(f"student has {h.shape[0]} positions, teacher {th.shape[0]}")
    vocab_s = s_head.weight.shape[0]
    vocab_t = t_head.weight.shape[0] if t_head is not None else th.shape[-1]
    if vocab_s != vocab_t:
        raise ValueError(
            f"student vocabulary {vocab_s} and teacher vocabulary {vocab_t} differ; "
            "the teacher must share the student's tokenizer"
        )
    y = labels.reshape(-1).to(h.device) if labels is not None else None
    opts = dict(
        temperature=float(temperature),
        alpha=float(alpha),
        chunk=chunk_size,
        ignore_index=ignore_index,
        dtype=_compute_dtype(student_hidden, s_head.weight),
        t_dtype=_compute_dtype(teacher_hidden, t_head.weight) if t_head is not None else None,
    )
    t_head_nograd = None if t_head is None else LMHead(t_head.weight.detach(), t_head.bias, t_head.scale, t_head.softcap)
    need = _needs(student_hidden, s_head.weight, s_head.bias)
    return _ChunkedKL.apply(h, s_head.weight, s_head.bias, th, s_head, t_head_nograd, y, opts, need)


def chunked_lm_loss(
    chunk_size: int = 1024, compiled: bool = False
) -> Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    """A ``train.loop`` loss: mean next-token CE through :func:`chunked_cross_entropy` (``compiled``:
    its per-chunk math through ``torch.compile``, for ``train.compile``)."""

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        return head_loss(
            model,
            batch["input_ids"],
            lambda h, head: chunked_cross_entropy(h, head, labels, chunk_size=chunk_size, compiled=compiled),
        )

    loss_fn.chunk_size = chunk_size  # type: ignore[attr-defined]
    loss_fn.compiled = compiled  # type: ignore[attr-defined]
    return loss_fn


@torch.no_grad()
def check_head_matches_logits(model: nn.Module, input_ids: torch.Tensor, atol: float = 1e-3) -> float:
    """Refuse models whose logits are not ``lm_head_of(model)(final hidden states)`` (e.g. a family that
    rescales hidden states inside its head); returns the max difference on a short sample."""
    was_training = model.training
    model.eval()  # no dropout: the comparison is exact and the global RNG is left untouched
    try:
        ids = input_ids[:1, : min(16, input_ids.shape[-1])]

        dtypes = []

        def logits(hidden, head):  # in the dtype the head computes in (bf16 under an FSDP bf16 policy)
            dtypes.append(_compute_dtype(hidden, head.weight))
            return _Head(head, dtypes[-1]).logits(hidden.reshape(-1, hidden.shape[-1]))[0]

        got, out = head_loss(model, ids, logits, keep_logits=True)
        ref = (out.logits if hasattr(out, "logits") else out).float()
        got = got.reshape(ref.shape)
    finally:
        model.train(was_training)
    diff = float((got - ref).abs().max())
    scale = float(ref.abs().max().clamp(min=1.0))
    if diff > max(atol, 8 * torch.finfo(dtypes[0]).eps) * scale:  # rounding passes; a rescaled head does not
        raise ChunkedLossError(
            f"{type(model).__name__}'s logits are not lm_head(final hidden states) (max difference {diff:.3g}); "
            "this family transforms logits in a way the chunked loss does not know: set train.loss.chunked: false"
        )
    return diff
