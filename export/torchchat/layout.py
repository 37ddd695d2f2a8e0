"""Hugging Face Llama-family model -> TorchChat's Meta layout (``model.pth`` keys, ``params.json``).

Which models map: Llama, Mistral (when the export's context fits its sliding window) and
Phi-3 (fused ``qkv_proj``/``gate_up_proj`` are split). Everything TorchChat's ``Transformer``
cannot compute is refused from the config alone, naming the stage that would fix it where one
exists, so ``optimize validate`` refuses before any stage runs.

RoPE: HF stores each head's q/k rows in "rotate-half" order (all first halves of the pairs,
then all second halves); Meta's reference and TorchChat rotate interleaved pairs. Converting
permutes the rows of ``wq``/``wk`` per head: HF ``(2, d/2)`` -> Meta ``(d/2, 2)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from export.base import ExportError

SUPPORTED = ("llama", "mistral", "phi3")
RMSNORM_RECORD = "edge_optimize_rmsnorm"  # written by the rmsnorm stage (and its planned_config)

_LN = ("LayerNorm", "rmsnorm")
_NOPE = ("learned absolute position embeddings instead of RoPE", None)
_BIAS = ("biases on the attention and MLP projections (torchchat's Llama has none)", None)
_PARTIAL = ("partial rotary embeddings (torchchat rotates the whole head)", None)
#: model_type -> (problem, stage that rewrites it or None) for families that are not Llama
FAMILY_PROBLEMS: dict[str, list[tuple[str, str | None]]] = {
    "gpt2": [_LN, _NOPE, ("a GELU MLP, not SwiGLU", None), _BIAS],
    "opt": [_LN, _NOPE, ("a ReLU MLP, not SwiGLU", None), _BIAS],
    "gpt_neox": [_LN, _PARTIAL, ("a GELU MLP, not SwiGLU", None), _BIAS],
    "phi": [_LN, _PARTIAL, ("a GELU MLP, not SwiGLU", None), _BIAS],
    "gptj": [_LN, _PARTIAL, ("a GELU MLP, not SwiGLU", None), _BIAS],
    "bloom": [_LN, ("ALiBi attention biases instead of RoPE", None), ("a GELU MLP, not SwiGLU", None), _BIAS],
    "stablelm": [_LN, _PARTIAL],
    "qwen2": [("biases on the q/k/v projections (torchchat's Llama has none)", None)],
    "qwen3": [("per-head RMSNorm on queries and keys (q_norm/k_norm), which torchchat's attention lacks", None)],
    "gemma": [("RMSNorm that scales by (1 + weight) and embeddings scaled by sqrt(hidden_size)", None),
              ("a GeGLU MLP (GELU-tanh gate), not SwiGLU", None)],
    "gemma2": [("a GeGLU MLP, logit soft-capping and alternating sliding-window layers", None)],
    "gemma3_text": [("a GeGLU MLP, q/k norms and alternating sliding-window layers", None)],
    "granite": [("Granite's embedding/attention/residual/logit multipliers", None)],
    "mixtral": [("a mixture-of-experts MLP", None)],
}


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def rope_settings(config: Any) -> dict:
    """``rope_type``, ``rope_theta``, ``partial_rotary_factor`` and scaling keys, whichever form the
    config uses (transformers 5's ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``)."""
    cfg = _text_config(config)
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)
    if isinstance(legacy, dict):
        rp = {**legacy, **rp}
    rp.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rp["rope_type"] = rp.get("rope_type", rp.get("type", "default")) or "default"
    rp.setdefault("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)
    return rp


def config_problems(config: Any, max_seq_len: int | None = None) -> list[str]:
    """Why TorchChat's Meta-layout Llama cannot represent this model ([] = it can). A sliding
    window is checked only when ``max_seq_len`` (the exported context) is given."""
    cfg = _text_config(config)
    mt = getattr(cfg, "model_type", None)
    record = getattr(cfg, RMSNORM_RECORD, None)
    if mt in FAMILY_PROBLEMS:
        out = []
        for what, fix in FAMILY_PROBLEMS[mt]:
            if fix == "rmsnorm" and record:
                continue  # the rmsnorm stage's rewrite leaves RMSNorm in place of LayerNorm
            how = f"the `{fix}` stage rewrites it" if fix else "no stage rewrites it"
            out.append(f"{mt} uses {what}; {how}")
        return out
    if mt not in SUPPORTED:
        return [f"architecture {mt!r} has no mapping to torchchat's Llama layout (supported: {', '.join(SUPPORTED)})"]
    out = []
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        out.append(f"hidden_act={act!r}: torchchat's FeedForward is SwiGLU (SiLU gate); no stage rewrites it")
    for flag, where in (("attention_bias", "attention"), ("mlp_bias", "MLP")):
        if getattr(cfg, flag, False):
            out.append(f"{flag}=True: biases on the {where} projections, which torchchat's Llama lacks")
    if record and record.get("added_bias"):
        out.append(f"the rmsnorm rewrite added biases to {len(record['added_bias'])} projections; torchchat has none")
    hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    if head_dim * heads != hidden:
        out.append(f"head_dim={head_dim} with {heads} heads does not equal hidden_size={hidden}; torchchat ignores "
                   f"head_dim and uses hidden_size // n_heads = {hidden // heads}")
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv:
        out.append(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    rope = rope_settings(cfg)
    if rope["rope_type"] not in ("default", "llama3"):
        out.append(f"rope_type={rope['rope_type']!r}: torchchat implements plain RoPE and Llama-3 scaling only")
    if float(rope["partial_rotary_factor"]) != 1.0:
        out.append(f"partial_rotary_factor={rope['partial_rotary_factor']}: torchchat rotates the whole head")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and max_seq_len is not None:
        if int(window) < max_seq_len:
            out.append(f"sliding-window attention (window {window}) beyond the export's context "
                       f"(max_seq_len={max_seq_len}); torchchat attends to the whole context. Export with "
                       f"max_seq_len <= {window} to make it exact")
    return out


def torchchat_params(config: Any, *, vocab_size: int, max_seq_len: int, tied: bool, tokenizer: str,
                     prepend_bos: bool) -> dict:
    """The flat params.json TorchChat's loader accepts (only keys it knows; every one set explicitly)."""
    cfg = _text_config(config)
    rope = rope_settings(cfg)
    params: dict[str, Any] = {
        "dim": int(cfg.hidden_size),
        "n_layers": int(cfg.num_hidden_layers),
        "n_heads": int(cfg.num_attention_heads),
        "n_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "vocab_size": int(vocab_size),
        "hidden_dim": int(cfg.intermediate_size),
        "norm_eps": float(cfg.rms_norm_eps),
        "rope_theta": float(rope["rope_theta"]),
        "max_seq_length": int(max_seq_len),
    }
    if max_seq_len > 2048:  # torchchat caps generation at block_size (default 2048)
        params["block_size"] = int(max_seq_len)
    if rope["rope_type"] == "llama3":
        params["rope_scaling"] = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                        "original_max_position_embeddings")}
    if tied:
        params["tie_word_embeddings"] = True
    if tokenizer == "hf":
        params["use_hf_tokenizer"] = True
    if not prepend_bos:
        params["tokenizer_prepend_bos"] = False
    return params


def _dense(w: torch.Tensor) -> torch.Tensor:
    """A plain float32 copy of a weight; torchao quantized weights are de-quantized."""
    if type(w) not in (torch.Tensor, nn.Parameter):
        w = w.dequantize()
    return w.detach().to(torch.float32).contiguous().clone()


def hf_to_meta_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k rows from HF's rotate-half order to Meta's interleaved pairs, per head."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def _no_bias(name: str, lin: nn.Module) -> None:
    if getattr(lin, "bias", None) is not None:
        raise ExportError(f"{name} has a bias; torchchat's Llama has none (the model is not Llama-compatible)")


def is_tied(model: nn.Module) -> bool:
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is emb.weight


def meta_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The Meta-layout checkpoint of an HF Llama/Mistral/Phi-3 model (float32, de-quantized)."""
    cfg = _text_config(model.config)
    problems = config_problems(cfg)  # the sliding window is checked against max_seq_len by the exporter
    if problems:
        raise ExportError("not representable in torchchat's Llama layout: " + "; ".join(problems))
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or not hasattr(base, "layers"):
        raise ExportError(f"{type(model).__name__} has no decoder with .layers; not a Llama-family causal LM")
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hd = int(cfg.hidden_size) // heads
    sd = {"tok_embeddings.weight": _dense(model.get_input_embeddings().weight), "norm.weight": _dense(base.norm.weight)}
    for i, layer in enumerate(base.layers):
        p, attn, mlp = f"layers.{i}", layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection
            _no_bias(f"{p}.qkv_proj", attn.qkv_proj)
            q, k, v = _dense(attn.qkv_proj.weight).split([heads * hd, kv * hd, kv * hd], dim=0)
        else:
            for n in ("q_proj", "k_proj", "v_proj"):
                _no_bias(f"model.layers.{i}.self_attn.{n}", getattr(attn, n))
            q, k, v = (_dense(getattr(attn, n).weight) for n in ("q_proj", "k_proj", "v_proj"))
        _no_bias(f"model.layers.{i}.self_attn.o_proj", attn.o_proj)
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate and up stacked, gate first
            _no_bias(f"{p}.gate_up_proj", mlp.gate_up_proj)
            gate, up = _dense(mlp.gate_up_proj.weight).chunk(2, dim=0)
        else:
            for n in ("gate_proj", "up_proj"):
                _no_bias(f"model.layers.{i}.mlp.{n}", getattr(mlp, n))
            gate, up = _dense(mlp.gate_proj.weight), _dense(mlp.up_proj.weight)
        _no_bias(f"model.layers.{i}.mlp.down_proj", mlp.down_proj)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if getattr(norm, "bias", None) is not None or not hasattr(norm, "weight"):
                raise ExportError(f"layer {i} has a {type(norm).__name__} with a bias; torchchat takes RMSNorm only")
        sd.update({
            f"{p}.attention.wq.weight": hf_to_meta_rope(q, heads),
            f"{p}.attention.wk.weight": hf_to_meta_rope(k, kv),
            f"{p}.attention.wv.weight": v.clone(),
            f"{p}.attention.wo.weight": _dense(attn.o_proj.weight),
            f"{p}.feed_forward.w1.weight": gate.clone(),
            f"{p}.feed_forward.w3.weight": up.clone(),
            f"{p}.feed_forward.w2.weight": _dense(mlp.down_proj.weight),
            f"{p}.attention_norm.weight": _dense(layer.input_layernorm.weight),
            f"{p}.ffn_norm.weight": _dense(layer.post_attention_layernorm.weight),
        })
    if not is_tied(model):
        head = model.get_output_embeddings()
        _no_bias("lm_head", head)
        sd["output.weight"] = _dense(head.weight)
    return sd
