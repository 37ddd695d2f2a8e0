"""An independent Meta-layout Llama: reads torchchat's ``model.pth`` + ``params.json`` and runs them.

Written from the published architecture (pre-norm RMSNorm blocks, grouped-query attention,
rotary embeddings applied to *interleaved* pairs ``(x[2i], x[2i+1])`` as in Meta's reference
code, SwiGLU feed-forward), not from transformers or torchchat, so that agreeing with the HF
model within 1e-4 shows the exported checkpoint is right, q/k permutation included.

:func:`parse_params` applies the rules torchchat's loader applies to ``params.json`` (unknown
keys fail, ``head_dim`` is derived, ``rope_scaling`` is null or Llama-3's four keys) and
:func:`load_checkpoint` loads the weights strictly, as torchchat does, so a file that loads
here loads there. :class:`MetaLlamaRunner` drives it through the project's checks.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from export.decoding.runtime import Runner, RunnerError

#: params.json keys torchchat's TransformerArgs accepts (``rope_theta``/``n_kv_heads`` are renamed
#: on load); anything else makes ``TransformerArgs(**params)`` raise.
TORCHCHAT_KEYS = frozenset({
    "block_size", "vocab_size", "n_layers", "n_heads", "dim", "hidden_dim", "n_local_heads", "head_dim",
    "rope_base", "norm_eps", "multiple_of", "ffn_dim_multiplier", "use_tiktoken", "use_hf_tokenizer",
    "tokenizer_prepend_bos", "max_seq_length", "rope_scaling", "n_stages", "stage_idx", "attention_bias",
    "feed_forward_bias", "tie_word_embeddings", "embedding_multiplier", "attention_multiplier",
    "residual_multiplier", "logits_scaling", "rope_theta", "n_kv_heads",
})
#: keys whose non-default values change the architecture beyond plain Llama (biases, Granite's
#: multipliers); this module refuses them rather than silently computing something else
_BIAS_KEYS = ("attention_bias", "feed_forward_bias")
_MULTIPLIER_KEYS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
LLAMA3_ROPE_KEYS = frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})


class ParamsError(ValueError):
    """params.json would not load in torchchat (or describes something this module cannot run)."""


@dataclass(frozen=True)
class MetaLlamaParams:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    norm_eps: float
    rope_theta: float
    max_seq_length: int = 8192  # torchchat's default
    block_size: int = 2048  # torchchat's default; generation is capped by it too
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    use_hf_tokenizer: bool = False
    use_tiktoken: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def parse_params(params: dict[str, Any]) -> MetaLlamaParams:
    """Validate a params.json dict the way torchchat's loader would, then read it."""
    if "model_type" in params:
        raise ParamsError(f"params.json has model_type={params['model_type']!r}; a text-only Llama has none")
    unknown = sorted(set(params) - TORCHCHAT_KEYS)
    if unknown:
        raise ParamsError(f"params.json has keys torchchat's TransformerArgs does not accept: {', '.join(unknown)}")
    for a, b in (("rope_theta", "rope_base"), ("n_kv_heads", "n_local_heads")):
        if a in params and b in params:
            raise ParamsError(f"params.json sets both {a} and {b} (torchchat renames {a} to {b})")
    odd = [k for k in _BIAS_KEYS if params.get(k)] + [k for k in _MULTIPLIER_KEYS if params.get(k) is not None]
    odd += [k for k, default in (("n_stages", 1), ("stage_idx", 0)) if params.get(k, default) != default]
    if odd:
        raise ParamsError(f"params.json sets {', '.join(odd)}; the Meta-layout reference runs plain Llama only")
    missing = [k for k in ("dim", "n_layers", "n_heads", "vocab_size", "hidden_dim", "norm_eps") if k not in params]
    if missing:
        raise ParamsError(f"params.json lacks {', '.join(missing)}; torchchat would fall back to Llama-2-7B defaults")
    theta = params.get("rope_theta", params.get("rope_base"))
    if theta is None:
        raise ParamsError("params.json lacks rope_theta; torchchat would use 10000")
    dim, heads = int(params["dim"]), int(params["n_heads"])
    if dim % heads:
        raise ParamsError(f"dim={dim} is not divisible by n_heads={heads}")
    if "head_dim" in params and int(params["head_dim"]) != dim // heads:
        raise ParamsError(f"head_dim={params['head_dim']} but torchchat always uses dim // n_heads = {dim // heads}")
    kv = int(params.get("n_kv_heads", params.get("n_local_heads", heads)))
    if kv < 1 or heads % kv:
        raise ParamsError(f"n_kv_heads={kv} must divide n_heads={heads}")
    scaling = params.get("rope_scaling")
    if scaling is not None and (not isinstance(scaling, dict) or not LLAMA3_ROPE_KEYS <= set(scaling)):
        raise ParamsError(
            f"rope_scaling={scaling!r}: torchchat takes null or a dict with {', '.join(sorted(LLAMA3_ROPE_KEYS))}"
        )
    if params.get("use_tiktoken") and params.get("use_hf_tokenizer"):
        raise ParamsError("params.json sets both use_tiktoken and use_hf_tokenizer")
    return MetaLlamaParams(
        dim=dim, n_layers=int(params["n_layers"]), n_heads=heads, n_kv_heads=kv,
        vocab_size=int(params["vocab_size"]), hidden_dim=int(params["hidden_dim"]),
        norm_eps=float(params["norm_eps"]), rope_theta=float(theta),
        max_seq_length=int(params.get("max_seq_length", 8192)), block_size=int(params.get("block_size", 2048)),
        rope_scaling=dict(scaling) if scaling else None, tie_word_embeddings=bool(params.get("tie_word_embeddings")),
        use_hf_tokenizer=bool(params.get("use_hf_tokenizer")), use_tiktoken=bool(params.get("use_tiktoken")),
    )


def rope_frequencies(p: MetaLlamaParams) -> torch.Tensor:
    """Per-pair angular frequencies theta^(-2i/d), with Llama 3.1's smooth long-context scaling.

    Computed in float32 as Meta's reference does: at position 500 a float64 table differs by
    about 1e-4 rad, which shows in the logits."""
    d = p.head_dim
    freqs = 1.0 / (p.rope_theta ** (torch.arange(0, d, 2).float() / d))
    s = p.rope_scaling
    if s:
        factor, lo, hi, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)
        scaled = (1 - smooth) * freqs / factor + smooth * freqs
        freqs = torch.where(wavelen < old / hi, freqs, torch.where(wavelen > old / lo, freqs / factor, scaled))
    return freqs


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each interleaved pair (x[2i], x[2i+1]) of x [B, T, H, D] by the position's angle."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, p: MetaLlamaParams, cache_len: int):
        super().__init__()
        hd = p.head_dim
        self.n_heads, self.n_kv, self.hd = p.n_heads, p.n_kv_heads, hd
        self.wq = nn.Linear(p.dim, p.n_heads * hd, bias=False)
        self.wk = nn.Linear(p.dim, p.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(p.dim, p.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(p.n_heads * hd, p.dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, p.n_kv_heads, cache_len, hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, p.n_kv_heads, cache_len, hd), persistent=False)

    def forward(self, x, cos, sin, input_pos, mask, end: int):
        b, t, _ = x.shape
        q = apply_rotary(self.wq(x).view(b, t, self.n_heads, self.hd), cos, sin).transpose(1, 2)
        k = apply_rotary(self.wk(x).view(b, t, self.n_kv, self.hd), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        self.k_cache[:, :, input_pos] = k.to(self.k_cache.dtype)
        self.v_cache[:, :, input_pos] = v.to(self.v_cache.dtype)
        keys = self.k_cache[:, :, :end].repeat_interleave(self.n_heads // self.n_kv, dim=1)
        values = self.v_cache[:, :, :end].repeat_interleave(self.n_heads // self.n_kv, dim=1)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, p: MetaLlamaParams):
        super().__init__()
        self.w1 = nn.Linear(p.dim, p.hidden_dim, bias=False)
        self.w2 = nn.Linear(p.hidden_dim, p.dim, bias=False)
        self.w3 = nn.Linear(p.dim, p.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, p: MetaLlamaParams, cache_len: int):
        super().__init__()
        self.attention = Attention(p, cache_len)
        self.feed_forward = FeedForward(p)
        self.attention_norm = RMSNorm(p.dim, p.norm_eps)
        self.ffn_norm = RMSNorm(p.dim, p.norm_eps)

    def forward(self, x, cos, sin, input_pos, mask, end: int):
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask, end)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    """``forward(tokens [1, T], input_pos [T]) -> logits [1, T, vocab]`` over a static KV cache."""

    def __init__(self, p: MetaLlamaParams, cache_len: int | None = None):
        super().__init__()
        self.params = p
        self.cache_len = int(cache_len or p.max_seq_length)
        self.tok_embeddings = nn.Embedding(p.vocab_size, p.dim)
        self.layers = nn.ModuleList(Block(p, self.cache_len) for _ in range(p.n_layers))
        self.norm = RMSNorm(p.dim, p.norm_eps)
        self.output = nn.Linear(p.dim, p.vocab_size, bias=False)
        angles = torch.outer(torch.arange(self.cache_len, dtype=torch.float32), rope_frequencies(p))
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        input_pos = input_pos.long()
        end = int(input_pos.max()) + 1  # attend over the filled prefix of the cache only
        if end > self.cache_len:
            raise RunnerError(f"position {end - 1} is outside the KV cache of {self.cache_len}")
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        mask = torch.arange(end, device=tokens.device)[None, :] <= input_pos[:, None]
        h = self.tok_embeddings(tokens.long())
        for layer in self.layers:
            h = layer(h, cos, sin, input_pos, mask, end)
        return self.output(self.norm(h))


def read_params(path: str | Path) -> MetaLlamaParams:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ParamsError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path} must hold a JSON object")
    return parse_params(data)


def expected_keys(p: MetaLlamaParams) -> set[str]:
    """The state-dict keys torchchat's strict load needs (``output.weight`` optional when tied)."""
    keys = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(p.n_layers):
        keys |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        keys |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        keys |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    return keys


def load_checkpoint(pth: str | Path, params: str | Path | MetaLlamaParams, *, cache_len: int | None = None) -> MetaLlama:
    """Load ``model.pth`` strictly (extra or missing keys fail, as in torchchat) into a MetaLlama."""
    p = params if isinstance(params, MetaLlamaParams) else read_params(params)
    try:
        sd = torch.load(str(pth), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise RunnerError(f"cannot load {pth} with torch.load(weights_only=True, mmap=True): {exc}") from None
    if p.tie_word_embeddings and "output.weight" not in sd:
        sd = dict(sd, **{"output.weight": sd.get("tok_embeddings.weight")})
    want = expected_keys(p)
    extra, missing = sorted(set(sd) - want), sorted(want - set(sd))
    if extra or missing:
        raise RunnerError(f"{pth} does not match params (torchchat loads strictly): "
                          f"unexpected keys {extra[:5]}, missing keys {missing[:5]}")
    with torch.device("meta"):
        model = MetaLlama(p, cache_len)
    model.load_state_dict(sd, strict=True, assign=True)  # buffers are non-persistent: rebuilt below
    if p.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    for name, buf in list(model.named_buffers()):
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if buf.is_meta:
            mod.register_buffer(attr, torch.zeros(buf.shape, dtype=torch.float32), persistent=False)
    angles = torch.outer(torch.arange(model.cache_len, dtype=torch.float32), rope_frequencies(p))
    model.rope_cos, model.rope_sin = angles.cos(), angles.sin()
    return model.eval()


class MetaLlamaRunner(Runner):
    """``model.pth`` + ``params.json`` in eager PyTorch through :class:`MetaLlama` (the reference
    for what torchchat's ``--checkpoint-path`` path computes)."""

    runtime = "torchchat-pth"

    def __init__(self, pth: str | Path, params: str | Path | None = None, *, max_seq_len: int | None = None):
        self.path = Path(pth)
        if not self.path.is_file():
            raise RunnerError(f"checkpoint {self.path} does not exist")
        self.params_path = Path(params) if params else self.path.with_name("params.json")
        p = read_params(self.params_path)
        self.max_seq_len = int(max_seq_len or p.max_seq_length)
        self.model = load_checkpoint(self.path, p, cache_len=self.max_seq_len)
        self._pos = 0

    def reset(self) -> None:
        self._pos = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        ids = self.checked_ids(ids)
        t = int(ids.numel())
        pos = torch.arange(self._pos, self._pos + t)
        logits = self.model(ids[None], pos)[0]
        self._pos += t
        return (logits if all_logits else logits[-1:]).float()

    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def describe(self) -> dict:
        return {"runtime": self.runtime, "artifact": str(self.path), "params_path": str(self.params_path),
                "max_seq_len": self.max_seq_len, "threads": torch.get_num_threads(),
                "params": asdict(self.model.params)}
