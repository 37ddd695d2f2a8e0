"""ExecuTorch's LLM ops inside a transformers causal LM, so its .pte decodes at memory speed.

transformers' own static-cache export keeps KV updates (``index_put``), GQA ``repeat_kv``
copies, per-layer masks and RMSNorm's ``mean`` in ExecuTorch's portable kernels, between
dozens of small XNNPACK subgraphs. Here instead, as optimum-executorch does:

* attention is an attention function registered with transformers' ``AttentionInterface``
  that calls ``llama::custom_sdpa`` (causal from a start position; GQA handled in the kernel);
  no mask function is registered, so transformers builds no mask at all;
* the KV cache is a transformers ``Cache`` whose layers store into ExecuTorch's
  ``CustomKVCache`` buffers through ``llama::update_cache`` (layout ``[B, S, H, D]``, which
  ``custom_sdpa`` reads directly, so no transposes of the cache);
* sliding-window layers whose window is shorter than the cache use ExecuTorch's ring buffer
  (``CachePositionsManager``, twice the window, ``update_cache_with_indices``); the ring
  indices and the window mask are computed once per call and shared by every sliding layer;
* RMSNorm and tanh-GELU are rewritten (:mod:`export.executorch.delegable`) so XNNPACK runs them.

:func:`plan_layers` says what a config needs (and what it cannot do) without weights, so the
exporter can refuse at validation time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from export.base import ExportError

ATTN_NAME = "executorch_custom_sdpa"
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class LayerPlan:
    """How one decoder layer's attention is exported: ``window`` None = full causal attention."""

    kind: str
    window: int | None = None

    @property
    def ring(self) -> bool:
        return self.window is not None


@dataclass
class ModelPlan:
    layers: list[LayerPlan]
    max_seq_len: int
    problems: list[str] = field(default_factory=list)
    #: attention logit soft-capping (Gemma-2): ``llama::custom_sdpa`` has none, so those layers
    #: attend with :func:`softcapped_attention` over the same cache
    softcap: float | None = None

    @property
    def windows(self) -> list[int]:
        return sorted({p.window for p in self.layers if p.window is not None})

    @property
    def max_chunk(self) -> int:
        """Most tokens one call may take: a ring of 2W slots takes W new tokens without
        overwriting keys its first query still needs."""
        return min([self.max_seq_len, *self.windows])


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def plan_layers(config: Any, max_seq_len: int) -> ModelPlan:
    """Per-layer attention plan for ``config`` at ``max_seq_len``, with the problems that stop it."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = _text_config(config)
    problems: list[str] = []
    n_layers = getattr(cfg, "num_hidden_layers", None)
    try:
        types, kwargs = get_layer_types_and_kwargs(cfg)
    except Exception as exc:  # configs without per-layer information
        return ModelPlan([], max_seq_len, [f"cannot read the attention layer types from the config ({exc})"])
    plans: list[LayerPlan] = []
    odd = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES})
    if odd:
        problems.append(
            f"layer types {', '.join(odd)} are not supported by the ExecuTorch custom-op attention "
            f"(supported: {', '.join(SUPPORTED_LAYER_TYPES)})"
        )
    for t, kw in zip(types, kwargs):
        window = kw.get("sliding_window") if t == "sliding_attention" else None
        # a window at least as long as the cache never binds: plain causal attention is exact
        plans.append(LayerPlan(t, int(window) if window is not None and window < max_seq_len else None))
    if n_layers is not None and len(plans) != n_layers:
        problems.append(f"config lists {len(plans)} layer types for {n_layers} layers")
    for p in plans:
        if p.window is not None and p.window < 1:
            problems.append(f"sliding_window={p.window} must be positive")
            break
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    return ModelPlan(plans, max_seq_len, problems, softcap=float(softcap) if softcap else None)


# ---------------------------------------------------------------------------------------------
# cache


class _CallState:
    """What one forward call shares across layers: start position and, per ring window, the
    slot indices and the additive mask (computed once in :meth:`ExecuTorchDecoder.forward`)."""

    def __init__(self) -> None:
        self.input_pos: torch.Tensor | None = None
        self.start_pos: Any = 0
        self.ring_indices: dict[int, torch.Tensor] = {}
        self.ring_masks: dict[int, torch.Tensor] = {}
        #: additive causal mask over a full-length cache, built only for soft-capped models
        self.full_mask: torch.Tensor | None = None
        #: the verify method's static row count (None: attend over the whole call at once)
        self.verify_rows: int | None = None
        self.n_tokens: Any = 1


def _cache_layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class CustomOpCacheLayer(CacheLayerMixin):
        """One layer's KV storage: an ExecuTorch ``CustomKVCache`` updated by ``llama::update_cache``
        (``update_cache_with_indices`` for a ring). Returns the raw ``[B, S, H, D]`` buffers, which
        only :func:`custom_sdpa_attention` consumes."""

        is_compileable = True
        is_sliding = False
        supports_early_init = False

        def __init__(self, store: nn.Module, plan: LayerPlan, state: _CallState):
            super().__init__()
            self.store, self.plan, self.state = store, plan, state
            self.is_sliding = plan.kind == "sliding_attention"
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
            return None

        def update(self, key_states, value_states, *args, **kwargs):
            # the same ops as CustomKVCache.update, with the start position read once per call
            # (not once per layer) and the [B, S, H, D] buffers returned untransposed
            k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)
            start = self.state.start_pos
            if self.plan.ring:
                idx = self.state.ring_indices[self.plan.window]
                torch.ops.llama.update_cache_with_indices(k, self.store.k_cache, start, idx)
                torch.ops.llama.update_cache_with_indices(v, self.store.v_cache, start, idx)
            else:
                torch.ops.llama.update_cache(k, self.store.k_cache, start)
                torch.ops.llama.update_cache(v, self.store.v_cache, start)
            return self.store.k_cache, self.store.v_cache

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.store.k_cache.shape[1], 0

        def get_seq_length(self) -> int:
            return self.state.start_pos

        def get_max_length(self) -> int:
            return self.store.k_cache.shape[1]

    return CustomOpCacheLayer


def _cache_class():
    from transformers.cache_utils import Cache

    class CustomOpCache(Cache):
        """transformers ``Cache`` over :class:`CustomOpCacheLayer` s (one per decoder layer)."""

        def __init__(self, layers):
            super().__init__(layers=layers)

        def get_seq_length(self, layer_idx: int = 0):
            return self.layers[0].state.start_pos

        def get_query_offset(self, layer_idx: int = 0):
            return self.layers[0].state.start_pos

    return CustomOpCache


# ---------------------------------------------------------------------------------------------
# attention


def custom_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: ``llama::custom_sdpa`` over the cache buffers.

    ``query`` is ``[B, H, T, D]`` (transformers' layout); ``key``/``value`` are the whole
    ``[B, S, Hkv, D]`` cache buffers returned by :class:`CustomOpCacheLayer`. Returns
    ``[B, T, H, D]`` as transformers' attention functions do.
    """
    state = getattr(module, "_et_state", None)
    plan = getattr(module, "_et_plan", None)
    if state is None or plan is None:
        raise ExportError(
            f"{type(module).__name__} reached the ExecuTorch attention function without its cache plan; "
            "this architecture routes attention differently from the supported ones"
        )
    if key.dim() != 4 or key.shape[1] != getattr(module, "_et_cache_len", -1):
        # called outside ExecuTorchDecoder (e.g. eager inference on the prepared copy): the C++
        # kernel would abort the process on the [B, H, S, D] keys of an ordinary cache
        raise ExportError(
            f"{type(module).__name__} was prepared for ExecuTorch export (its attention reads the custom-op "
            "cache); run eager inference on the original model, not on the exporter's copy"
        )
    for unsupported in ("s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise ExportError(f"{type(module).__name__} uses {unsupported}, which llama::custom_sdpa does not support")
    if kwargs.get("softcap") is not None:
        mask = state.ring_masks[plan.window] if plan.ring else state.full_mask
        return softcapped_attention(query, key, value, mask, scaling, float(kwargs["softcap"])), None
    q = query.transpose(1, 2)
    if state.verify_rows is not None:  # never a ring: model_problems refuses verify_tokens beside one
        return rowwise_sdpa(q, key, value, state.start_pos, state.n_tokens, state.verify_rows, scaling), None
    if plan.ring:
        out = torch.ops.llama.custom_sdpa(q, key, value, 0, state.ring_masks[plan.window], 0.0, False, scaling)
    else:
        out = torch.ops.llama.custom_sdpa(q, key, value, state.start_pos, None, 0.0, True, scaling)
    return out, None


def rowwise_sdpa(q, key, value, start, n, rows: int, scaling) -> torch.Tensor:
    """``llama::custom_sdpa`` one query row at a time: row ``i`` of a call is attended exactly as a
    one-token call at position ``start + i`` attends, bit for bit.

    The kernel attends a block of query rows with one GEMM over the keys, and a GEMM of several rows
    does not sum in the order a one-row GEMM does (about 3e-7 apart in float32): in a program with
    dynamically quantized activations such differences flip roundings downstream, and a call's
    logits then differ from one-token calls' by a few percent of their scale. Speculative decoding
    needs a verification call to choose exactly what plain decoding would, so the verify method
    attends row by row. ``rows`` is static (the most tokens a verification call takes); a call of
    ``n < rows`` tokens repeats its last row, attended from position 0 (one key: a call's fixed cost,
    not a row's attention), and drops the repeats. ``q`` is ``[B, T, H, D]``; the cache already
    holds every fed position."""
    padded = torch.cat([q, q[:, -1:].expand(-1, rows, -1, -1)], dim=1)[:, :rows]
    # row r < n attends from start + r; a repeat (r >= n, where n - r <= 0) from 0, where the kernel reads
    # one key ((n - r) * S exceeds every position while r < n, so sym_min keeps start + r)
    cache_len = key.shape[1]
    outs = []
    for r in range(rows):
        at = start if r == 0 else torch.sym_min(start + r, torch.sym_max(0, (n - r) * cache_len))
        outs.append(torch.ops.llama.custom_sdpa(padded[:, r : r + 1], key, value, at, None, 0.0, True, scaling))
    return torch.cat(outs, dim=1)[:, :n]


def softcapped_attention(query, key, value, mask, scaling, softcap: float) -> torch.Tensor:
    """Attention with logit soft-capping (``tanh(s / cap) * cap``, Gemma-2) in plain ops over the
    custom-op cache, for the layers ``llama::custom_sdpa`` cannot run. ``query`` is
    ``[B, H, T, D]``, ``key``/``value`` the ``[B, S, Hkv, D]`` buffers, ``mask`` the call's
    additive ``[T, S]`` mask; grouped heads attend without copying keys per head."""
    b, h, t, d = query.shape
    hkv = key.shape[2]
    g = h // hkv
    k = key.transpose(1, 2)  # [B, Hkv, S, D]
    v = value.transpose(1, 2)
    q = query.reshape(b, hkv, g * t, d)  # head h = kv * g + i: the g query heads of a kv head
    scores = torch.matmul(q, k.transpose(2, 3)) * (scaling if scaling is not None else d ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask.repeat(g, 1)
    out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)  # [B, Hkv, G*T, D]
    return out.reshape(b, h, t, d).transpose(1, 2)


def register_attention() -> None:
    """Register :func:`custom_sdpa_attention` with transformers (idempotent), and load the ops."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama::*)
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, custom_sdpa_attention)


# ---------------------------------------------------------------------------------------------
# the exported module


class ExecuTorchDecoder(nn.Module):
    """``forward(tokens[1, T], input_pos[T]) -> logits[1, T, V]`` (``[1, 1, V]`` with
    ``last_logits``) with the cache as buffers.

    Attaches the call state and each layer's plan to the model's attention modules (found by
    their ``layer_idx``) and switches the model's attention implementation to
    :data:`ATTN_NAME`: give it a copy of the model.
    """

    def __init__(self, model: nn.Module, plan: ModelPlan, dtype: torch.dtype = torch.float32,
                 last_logits: bool = False, verify_rows: int | None = None):
        super().__init__()
        #: attend row by row, for calls of at most this many tokens (the verify method; rowwise_sdpa)
        self.verify_rows = verify_rows
        #: return logits for the last fed position only (what generation reads): prefill then
        #: skips the output projection for every other prompt token
        self.last_logits = last_logits
        from executorch.examples.models.llama.attention import CachePositionsManager
        from executorch.examples.models.llama.source_transformation.custom_kv_cache import CustomKVCache

        register_attention()
        self.model = model
        self.plan = plan
        self.state = _CallState()
        from transformers.configuration_utils import get_head_shapes

        n_kv, head_dim = get_head_shapes(_text_config(model.config))  # an int, or one per layer
        n = len(plan.layers)
        n_kv = n_kv if isinstance(n_kv, list) else [n_kv] * n
        head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * n
        self.stores = nn.ModuleList(
            CustomKVCache(1, 2 * p.window if p.ring else plan.max_seq_len, h, d, dtype=dtype)
            for p, h, d in zip(plan.layers, n_kv, head_dim)
        )
        # one ring-position tracker per distinct window, shared by its layers
        self.rings = nn.ModuleDict({str(w): CachePositionsManager(2 * w) for w in plan.windows})
        layer_cls, cache_cls = _cache_layer_class(), _cache_class()
        self.cache = cache_cls([layer_cls(s, p, self.state) for s, p in zip(self.stores, plan.layers)])
        attn = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
                and type(m).__name__.endswith("Attention")]
        if len(attn) != len(plan.layers):
            raise ExportError(
                f"found {len(attn)} attention modules with a layer_idx for {len(plan.layers)} layers; "
                "this architecture is not supported by the ExecuTorch custom-op export"
            )
        for m in attn:
            m._et_state = self.state
            m._et_plan = plan.layers[m.layer_idx]
            m._et_cache_len = int(self.stores[m.layer_idx].k_cache.shape[1])
        model.config._attn_implementation = ATTN_NAME

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        from executorch.examples.models.llama.attention import _create_causal_mask_for_ring_buffer

        n = tokens.shape[1]
        start = input_pos[0].item()
        torch._check_is_size(start)
        torch._check(start + n <= self.plan.max_seq_len)
        state = self.state
        state.input_pos, state.start_pos = input_pos, start
        state.verify_rows, state.n_tokens = self.verify_rows, n
        if self.verify_rows is not None:
            torch._check(n <= self.verify_rows)
        state.ring_indices, state.ring_masks = {}, {}
        for w in self.plan.windows:
            ring = self.rings[str(w)]
            idx = ring.calculate_positions_and_update_indices(input_pos, n)
            state.ring_indices[w] = idx.unsqueeze(0)
            state.ring_masks[w] = _create_causal_mask_for_ring_buffer(ring.cache_positions, w, start, n)
        if self.plan.softcap is not None and any(not p.ring for p in self.plan.layers):
            k_pos = torch.arange(self.plan.max_seq_len, dtype=torch.long).unsqueeze(0)
            visible = k_pos <= input_pos.unsqueeze(1)
            state.full_mask = torch.where(visible, 0.0, float("-inf"))
        out = self.model(
            input_ids=tokens,
            position_ids=input_pos.unsqueeze(0),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if self.last_logits else 0,
        )
        return out.logits
