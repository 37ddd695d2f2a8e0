"""Local (sliding-window) and local+global attention patterns, dense and blockwise.

One definition of the pattern serves every path, so they cannot drift apart:
query ``q`` may attend key ``k`` iff ``k <= q`` and (``q - k < window`` or ``k < global_tokens``).
``window`` counts the query itself (``window=1`` is attention to self only), as transformers'
``sliding_window`` does; the first ``global_tokens`` positions stay visible to every query
(attention sinks / Longformer-style global tokens), which makes the pattern sparse but not banded.

- :func:`pattern_mask_function` is a transformers mask function (index-based, so it builds
  dense boolean/additive masks and flex_attention ``BlockMask``s alike);
- :func:`dense_pattern_mask` is the plain ``[T, T]`` reference the tests compare against;
- :func:`blockwise_local_attention` computes the pattern block by block with SDPA: each block of
  queries sees only its key band (plus the global keys), so memory and compute grow as
  ``O(T * window)`` instead of ``O(T^2)``, on any SDPA kernel and any device.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def pattern_mask_function(window: int, global_tokens: int = 0) -> Callable:
    """The window/global part of the pattern; AND it onto a causal mask function."""

    def local_global(batch_idx, head_idx, q_idx, kv_idx):
        near = q_idx - kv_idx < window
        return near | (kv_idx < global_tokens) if global_tokens else near

    return local_global


def dense_pattern_mask(length: int, window: int, global_tokens: int = 0, device=None) -> torch.Tensor:
    """``[length, length]`` boolean mask (True = attend) of the causal local+global pattern."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return (k <= q) & ((q - k < window) | (k < global_tokens))


def query_block(window: int) -> int:
    """Queries per SDPA call: a block of ``b`` queries reads ``b + window - 1`` keys, so compute is
    ``T * (b + window)``; ``b`` near the window (within [128, 512]) keeps that near ``2 T W`` or
    better while the number of calls stays small."""
    return min(512, max(128, window))


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def blockwise_local_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    window: int,
    global_tokens: int = 0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``[B, H, T, D]`` in, ``[B, T, H, D]`` out) for the pattern.

    A model's own ``sliding_window`` (Mistral, Gemma-2/3 sliding layers) narrows the window
    further, as transformers' mask would. Training only: keys must be the queries' own tokens
    (no KV cache), and there is no padding (packed windows).
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("blockwise local attention runs on SDPA, which has no attention-logit softcap; use eager")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"blockwise local attention is for training (queries {query.shape[2]} == keys {key.shape[2]}); "
            "it does not run with a KV cache"
        )
    native = kwargs.get("sliding_window")
    w = min(window, native) if native else window
    key = _repeat_kv(key, query.shape[1] // key.shape[1])
    value = _repeat_kv(value, query.shape[1] // value.shape[1])
    length, step = query.shape[2], query_block(w)
    dev = query.device
    outs = []
    for s in range(0, length, step):
        e = min(s + step, length)
        lo = max(0, s - w + 1)  # the first key any query of this block sees through its window
        g = min(global_tokens, lo)  # global keys not already inside the band
        q = query[:, :, s:e]
        if lo == 0 and s == 0 and not g and e <= w:  # a plain causal block: let SDPA skip the mask
            outs.append(F.scaled_dot_product_attention(q, key[:, :, :e], value[:, :, :e], dropout_p=dropout,
                                                       is_causal=True, scale=scaling))
            continue
        if g:
            k = torch.cat([key[:, :, :g], key[:, :, lo:e]], dim=2)
            v = torch.cat([value[:, :, :g], value[:, :, lo:e]], dim=2)
            kv_idx = torch.cat([torch.arange(g, device=dev), torch.arange(lo, e, device=dev)])
        else:
            k, v = key[:, :, lo:e], value[:, :, lo:e]
            kv_idx = torch.arange(lo, e, device=dev)
        q_idx = torch.arange(s, e, device=dev)[:, None]
        kv_idx = kv_idx[None, :]
        allowed = (kv_idx <= q_idx) & ((q_idx - kv_idx < w) | (kv_idx < global_tokens))
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scaling))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None
