"""Attention for training: pick the implementation and SDPA kernel, apply a window or sparse
pattern, refuse what the device cannot run, and find out which kernel actually ran.

Everything goes through transformers' own extension points, so every model family that
follows the AttentionInterface works unchanged:

- the implementation is ``model.set_attn_implementation`` (sdpa, eager, flash_attention_2,
  flex_attention);
- a window or local+global pattern registers one named implementation with
  ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface`` (its mask):
  ``mask`` mode ANDs the pattern onto the model's causal mask (dense for sdpa/eager, a
  block-sparse ``BlockMask`` for flex_attention, flash-attn's own ``window_size``), ``blockwise``
  mode builds no mask and runs :func:`train.local_attention.blockwise_local_attention`;
- the SDPA kernel is ``torch.nn.attention.sdpa_kernel``, active in forward *and* backward
  (activation checkpointing recomputes attention there);
- "which kernel ran" is observed, not echoed: a ``TorchFunctionMode`` watches the first
  forward and asks SDPA's dispatcher (``torch._fused_sdp_choice``) which backend it picks
  for each call's actual inputs; flash-attn and flex_attention calls are seen by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from train.config import AttentionConfig
from train.local_attention import blockwise_local_attention, pattern_mask_function

log = logging.getLogger("optimize.train")

_KERNEL_ENUM = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
_CHOICE_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


class AttentionError(ValueError):
    """The requested attention cannot run here; the message says what would."""


def hf_model(model: nn.Module, required: bool = True) -> nn.Module | None:
    """The transformers model inside peft/FSDP wrappers (the one whose config drives attention)."""
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m, "set_attn_implementation"):
            return m
    if required:
        raise AttentionError(f"{type(model).__name__} is not a transformers model; train.attention needs one")
    return None


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, _KERNEL_ENUM[name])


def sdpa_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> str:
    """The backend SDPA's dispatcher picks for these inputs under the active ``sdpa_kernel`` (or 'none')."""
    try:
        idx = int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
    except RuntimeError:
        return "none"
    return _CHOICE_NAMES.get(idx, "none")


def usable_sdpa_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool, heads: int = 2,
                        kv_heads: int | None = None) -> list[str]:
    """SDPA kernels that can run attention with these properties on this device (probed, not assumed).

    The probe has the shapes transformers' SDPA integration passes: with grouped-query attention
    (``kv_heads < heads``) and no mask, k/v keep their own heads and ``enable_gqa`` is set, which
    the efficient kernel cannot run (a pinned ``efficient`` died at step 1 on an H200 with "No
    available kernel"); with a mask, k/v are repeated to every query head first."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    kv_heads = kv_heads or heads
    q = torch.zeros(1, heads, 16, head_dim, device=device, dtype=dtype)
    kv = torch.zeros(1, kv_heads, 16, head_dim, device=device, dtype=dtype)
    mask = torch.ones(16, 16, dtype=torch.bool, device=device).tril() if masked else None
    gqa = kv_heads != heads and use_gqa_in_sdpa(mask, kv, kv)
    if kv_heads != heads and not gqa:
        kv = kv.repeat_interleave(heads // kv_heads, dim=1)  # transformers' repeat_kv
    found = []
    for name in _KERNEL_ENUM:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([_sdpa_backend(name)]):
            if sdpa_choice(q, kv, kv, mask, 0.0, mask is None, enable_gqa=gqa) == name:
                found.append(name)
    return found


def check_backend_available(backend: str, device: torch.device) -> None:
    """Refuse an implementation this device cannot train with, before any work."""
    if backend == "flash_attention_2":
        if device.type != "cuda":
            raise AttentionError(
                f"attention.backend flash_attention_2 needs a CUDA device; this run is on {device.type}. "
                "Use sdpa (its flash kernel also runs on CPU)"
            )
        if importlib.util.find_spec("flash_attn") is None:
            raise AttentionError(
                "attention.backend flash_attention_2 needs the flash-attn package (the [gpu] extra); "
                "it is not installed. Use sdpa with sdpa_kernel: flash"
            )
    if backend == "flex_attention":
        from torch.nn.attention.flex_attention import flex_attention

        q = torch.zeros(1, 1, 128, 16, device=device, requires_grad=True)
        try:
            flex_attention(q, q, q).sum().backward()
        except Exception as exc:  # torch raises NotImplementedError/RuntimeError per device
            raise AttentionError(
                f"attention.backend flex_attention cannot train on {device.type}: {exc}. "
                "Use sdpa (with sliding_window the blockwise path is block-sparse too)"
            ) from None


@dataclass
class AttentionSetup:
    """What the loop applied; the kernels seen at each window length come from :class:`KernelRecorder`
    (the first forward of each curriculum stage: with a window, short stages may need no mask)."""

    implementation: str  # the transformers implementation (sdpa, eager, ...)
    registered: str  # the name set on the model config (== implementation without a pattern)
    previous: str
    sdpa_kernel: str
    window: int | None = None
    global_tokens: int = 0
    mode: str | None = None  # "mask" | "blockwise" when a pattern is applied
    by_length: dict[int, Counter] = field(default_factory=dict)

    def context(self):
        """``sdpa_kernel`` restricted to the chosen kernel (a no-op for 'auto')."""
        if self.sdpa_kernel == "auto":
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel([_sdpa_backend(self.sdpa_kernel)])

    def observe(self, seq_len: int, kernels: Counter) -> None:
        self.by_length[seq_len] = kernels

    @property
    def kernel(self) -> str:
        """The observed kernel(s) over all lengths, e.g. 'sdpa:flash' or 'eager (matmul + softmax)'."""
        names = sorted({k for c in self.by_length.values() for k in c})
        return " + ".join(names) if names else "not observed"

    def describe(self, seq_len: int) -> str:
        seen = self.by_length.get(seq_len, Counter())
        calls = ", ".join(f"{k} x{n}" for k, n in seen.most_common()) or "no attention kernel seen"
        text = f"attention at seq_len {seq_len}: {calls} per forward"
        text += f" (implementation {self.implementation}, sdpa_kernel {self.sdpa_kernel}"
        if self.window:
            text += f", {self.mode} window {self.window}"
            if self.global_tokens:
                text += f" + {self.global_tokens} global tokens"
        return text + ")"

    def report(self) -> dict:
        return {
            "kernel": self.kernel,
            "kernel_calls_by_seq_len": {n: dict(c) for n, c in sorted(self.by_length.items())},
            "implementation": self.implementation,
            "sdpa_kernel": self.sdpa_kernel,
            "sliding_window": self.window,
            "global_tokens": self.global_tokens,
            "window_mode": self.mode,
        }


class KernelRecorder(TorchFunctionMode):
    """Watches one forward: which attention kernels run (observed from the calls' real inputs)."""

    def __init__(self):
        super().__init__()
        self.kernels: Counter = Counter()
        self.softmax = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is F.scaled_dot_product_attention:
            self.kernels[f"sdpa:{self._choice(args, kwargs)}"] += 1
        elif "flash_attn" in str(func) or name.startswith("_flash_attn") or name.startswith("flash_attn"):
            self.kernels["flash_attn"] += 1
        elif name == "flex_attention" or "FlexAttention" in type(func).__name__:
            self.kernels["flex_attention"] += 1
        elif name in ("softmax", "_softmax"):
            self.softmax += 1
        return func(*args, **kwargs)

    @staticmethod
    def _choice(args, kwargs) -> str:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        defaults = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
        b = defaults | bound
        q, k, v = b["query"], b["key"], b["value"]
        dev = q.device.type
        if torch.is_autocast_enabled(dev):  # the dispatcher sees q, k, v after autocast's cast (RoPE leaves q, k fp32)
            dt = torch.get_autocast_dtype(dev)
            q, k, v = (t.to(dt) if t.is_floating_point() else t for t in (q, k, v))
        return sdpa_choice(q, k, v, b["attn_mask"], b["dropout_p"], b["is_causal"], b["scale"], b["enable_gqa"])

    def observed(self) -> Counter:
        if not self.kernels and self.softmax:
            return Counter({"eager (matmul + softmax)": self.softmax})
        return self.kernels


# --------------------------------------------------------------------------- patterns


def _own_eager(module: nn.Module):
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise AttentionError(f"{type(module).__name__} has no eager_attention_forward; use backend sdpa")
    return fn


def _register_pattern(base: str, window: int, global_tokens: int, mode: str) -> str:
    """Register (idempotently) the attention + mask functions of one pattern; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
        and_masks,
        causal_mask_function,
        or_masks,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"train_{mode}_{base}_w{window}_g{global_tokens}"
    if name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return name
    near = pattern_mask_function(window)

    def is_global(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx < global_tokens

    if mode == "blockwise":

        def attention(module, query, key, value, attention_mask, **kwargs):
            return blockwise_local_attention(
                module, query, key, value, attention_mask, window=window, global_tokens=global_tokens, **kwargs
            )

        def mask(*args, attention_mask=None, **kwargs):  # the band is built per block: no [T, T] mask at all
            if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
                raise ValueError("blockwise local attention takes packed windows only (no padding in attention_mask)")
            return None

    else:
        base_mask = ALL_MASK_ATTENTION_FUNCTIONS[base]

        def attention(module, query, key, value, attention_mask, **kwargs):
            if base == "eager":
                return _own_eager(module)(module, query, key, value, attention_mask, **kwargs)
            if base.startswith("flash_attention"):  # flash-attn applies the window itself (window_size)
                native = kwargs.pop("sliding_window", None)
                kwargs["sliding_window"] = min(window, native) if native else window
            return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, **kwargs)

        def mask(*args, mask_function=None, **kwargs):
            if mask_function is not None and not base.startswith("flash_attention"):
                # the window narrows the model's own mask (a native sliding window stays in force); global
                # tokens stay visible to every query, even past a native window (as in the blockwise path)
                mask_function = and_masks(mask_function, near)
                if global_tokens:
                    mask_function = or_masks(mask_function, and_masks(causal_mask_function, is_global))
                kwargs["allow_is_causal_skip"] = False  # the pattern is not plain causal
            if mask_function is not None:
                kwargs["mask_function"] = mask_function
            return base_mask(*args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


def _set_implementation(hf: nn.Module, name: str) -> None:
    hf.config._attn_implementation = name
    for m in hf.modules():  # sub-models with their own config object (rare for causal LMs)
        cfg = getattr(m, "config", None)
        if cfg is not None and cfg is not hf.config and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def auto_flash_attn(hf, cfg: AttentionConfig, device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """``"flash_attention_2"`` when nothing pins the backend and flash-attn can run here: a CUDA
    device, the flash-attn package installed, fp16/bf16 compute, a model transformers can run on
    it, and no option flash-attn lacks (global tokens, a forced SDPA kernel or blockwise windows).
    Otherwise None: SDPA (or the model's own choice) stays."""
    if cfg.backend is not None or cfg.sdpa_kernel != "auto" or cfg.global_tokens or cfg.window_impl == "blockwise":
        return None
    if device.type != "cuda" or compute_dtype not in (torch.float16, torch.bfloat16):
        return None
    if not getattr(hf, "_supports_flash_attn", False) or hf.config._attn_implementation not in (None, "sdpa"):
        return None
    if importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available():
        return None
    return "flash_attention_2"


def configure_attention(
    model: nn.Module, cfg: AttentionConfig, device: torch.device, compute_dtype: torch.dtype, seq_len: int
) -> AttentionSetup:
    """Apply ``cfg`` to ``model`` (before LoRA/FSDP wrapping); raises :class:`AttentionError` early.

    A model that is not a transformers model trains as it is when ``cfg`` asks for nothing."""
    asks = cfg.backend is not None or cfg.sliding_window is not None or cfg.sdpa_kernel != "auto"
    hf = hf_model(model, required=asks)
    if hf is None:
        return AttentionSetup("model's own", "model's own", "model's own", "auto")
    previous = hf.config._attn_implementation
    auto = auto_flash_attn(hf, cfg, device, compute_dtype)
    if auto:
        log.info("attention: flash-attn is installed and this is CUDA %s: using flash_attention_2 "
                 "(set train.attention.backend: sdpa to keep SDPA)", str(compute_dtype).removeprefix("torch."))
        asks = True
    if not asks:  # nothing requested: keep whatever the model runs (the kernel is still observed)
        return AttentionSetup(str(previous), str(previous), previous, "auto")
    impl = cfg.backend or auto or previous or "sdpa"
    if impl not in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
        raise AttentionError(f"the model uses attention {impl!r}; set train.attention.backend explicitly")
    if cfg.sliding_window is not None and cfg.sliding_window >= seq_len:
        raise AttentionError(
            f"attention.sliding_window {cfg.sliding_window} is not smaller than the training context "
            f"({seq_len} tokens): every token would see the whole window; drop it or lower it"
        )
    check_backend_available(impl, device)
    if cfg.sdpa_kernel != "auto":
        if impl != "sdpa":
            raise AttentionError(f"attention.sdpa_kernel {cfg.sdpa_kernel} applies to backend sdpa, not {impl}")
        heads = hf.config.num_attention_heads
        kv_heads = getattr(hf.config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // heads
        usable = usable_sdpa_kernels(device, compute_dtype, head_dim, masked=cfg.sliding_window is not None,
                                     heads=heads, kv_heads=kv_heads)
        if cfg.sdpa_kernel not in usable:
            what = f"{str(compute_dtype).removeprefix('torch.')}, head_dim {head_dim}"
            what += f", {heads} query heads sharing {kv_heads} KV heads" if kv_heads != heads else ""
            what += ", with a mask" if cfg.sliding_window is not None else ""
            raise AttentionError(
                f"attention.sdpa_kernel {cfg.sdpa_kernel} cannot run on {device.type} ({what}); "
                f"usable here: {', '.join(usable) or 'none'}"
            )
    try:
        if impl != previous:
            hf.set_attn_implementation(impl)
    except (ValueError, ImportError) as exc:
        raise AttentionError(f"attention.backend {impl}: {exc}") from None
    setup = AttentionSetup(impl, impl, previous, cfg.sdpa_kernel)
    if cfg.sliding_window is not None:
        mode = cfg.window_impl if cfg.window_impl != "auto" else ("blockwise" if impl == "sdpa" else "mask")
        if mode == "blockwise" and impl != "sdpa":
            raise AttentionError(f"attention.window_impl blockwise runs on SDPA; backend is {impl}")
        if impl.startswith("flash_attention") and cfg.global_tokens:
            raise AttentionError("attention.global_tokens: flash-attn has windows but no global tokens; use sdpa")
        setup.registered = _register_pattern(impl, cfg.sliding_window, cfg.global_tokens, mode)
        setup.window, setup.global_tokens, setup.mode = cfg.sliding_window, cfg.global_tokens, mode
        _set_implementation(hf, setup.registered)
    return setup


def restore_attention(model: nn.Module, setup: AttentionSetup) -> None:
    """Give the model back its own implementation (the pattern was a training-time choice)."""
    hf = hf_model(model, required=False)
    if hf is not None and hf.config._attn_implementation != setup.previous:
        try:
            hf.set_attn_implementation(setup.previous)
        except (ValueError, ImportError, KeyError):
            _set_implementation(hf, setup.previous)
