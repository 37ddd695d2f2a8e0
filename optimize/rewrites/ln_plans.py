"""Per-architecture maps of where the residual stream is read and written.

An exact LayerNorm -> RMSNorm rewrite needs to know, for each architecture: the embeddings
added to the residual stream, each LayerNorm with the linear layers that read its output,
and the linear layers that write into the stream. A plan is just module names, so a new
architecture is one small function here; anything without a plan is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


class RewriteRefused(ValueError):
    """The exact rewrite does not apply to this model; the message names the architecture and why."""


@dataclass
class LNPlan:
    arch: str
    #: embeddings whose rows are added to the residual stream (token, learned positions)
    embeddings: list[str]
    #: (LayerNorm, linear layers reading its output); one norm may feed several (parallel blocks)
    norms: list[tuple[str, list[str]]]
    #: linear layers whose output is added to the residual stream
    writers: list[str]
    #: the output embedding (also listed as a reader of the final norm)
    head: str
    notes: list[str] = field(default_factory=list)


def _gpt2(model) -> LNPlan:
    cfg = model.config
    if getattr(cfg, "add_cross_attention", False):
        raise RewriteRefused("gpt2 with add_cross_attention: cross-attention reads encoder states; not supported")
    norms, writers = [], []
    for i in range(cfg.num_hidden_layers):
        p = f"transformer.h.{i}"
        norms += [(f"{p}.ln_1", [f"{p}.attn.c_attn"]), (f"{p}.ln_2", [f"{p}.mlp.c_fc"])]
        writers += [f"{p}.attn.c_proj", f"{p}.mlp.c_proj"]
    norms.append(("transformer.ln_f", ["lm_head"]))
    return LNPlan("gpt2", ["transformer.wte", "transformer.wpe"], norms, writers, "lm_head")


def _opt(model) -> LNPlan:
    cfg = model.config
    if not cfg.do_layer_norm_before:
        raise RewriteRefused(
            "opt with do_layer_norm_before=False (post-LayerNorm, like opt-350m): each LayerNorm normalizes the "
            "residual stream itself after the add, so it cannot be folded into neighbouring linears and no exact "
            "RMSNorm form exists. Set approximate: true to swap the norms anyway (then heal)."
        )
    if cfg.word_embed_proj_dim != cfg.hidden_size:
        raise RewriteRefused(
            f"opt with word_embed_proj_dim={cfg.word_embed_proj_dim} != hidden_size={cfg.hidden_size}: "
            "project_in/project_out around the stack are not handled by the exact rewrite"
        )
    if getattr(cfg, "_remove_final_layer_norm", False):
        raise RewriteRefused("opt with _remove_final_layer_norm=True: no final LayerNorm to absorb the centring")
    d = "model.decoder"
    norms, writers = [], []
    for i in range(cfg.num_hidden_layers):
        p = f"{d}.layers.{i}"
        attn = [f"{p}.self_attn.{n}_proj" for n in "qkv"]
        norms += [(f"{p}.self_attn_layer_norm", attn), (f"{p}.final_layer_norm", [f"{p}.fc1"])]
        writers += [f"{p}.self_attn.out_proj", f"{p}.fc2"]
    norms.append((f"{d}.final_layer_norm", ["lm_head"]))
    return LNPlan("opt", [f"{d}.embed_tokens", f"{d}.embed_positions"], norms, writers, "lm_head")


def _gpt_neox(model) -> LNPlan:
    cfg = model.config
    norms, writers = [], []
    for i in range(cfg.num_hidden_layers):
        p = f"gpt_neox.layers.{i}"
        # parallel or not, each norm reads the residual stream once; the fold is the same
        norms += [
            (f"{p}.input_layernorm", [f"{p}.attention.query_key_value"]),
            (f"{p}.post_attention_layernorm", [f"{p}.mlp.dense_h_to_4h"]),
        ]
        writers += [f"{p}.attention.dense", f"{p}.mlp.dense_4h_to_h"]
    norms.append(("gpt_neox.final_layer_norm", ["lm_head"]))
    notes = [f"use_parallel_residual={cfg.use_parallel_residual}"]
    return LNPlan("gpt_neox", ["gpt_neox.embed_in"], norms, writers, "lm_head", notes)


def _phi(model) -> LNPlan:
    cfg = model.config
    if getattr(cfg, "qk_layernorm", False):
        raise RewriteRefused(
            "phi with qk_layernorm=True: the per-head q/k LayerNorms normalize attention inputs, not the residual "
            "stream, and the exact rewrite leaves no LayerNorm behind; not supported"
        )
    norms, writers = [], []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        # one LayerNorm feeds both the attention and the MLP (parallel block)
        readers = [f"{p}.self_attn.{n}_proj" for n in "qkv"] + [f"{p}.mlp.fc1"]
        norms.append((f"{p}.input_layernorm", readers))
        writers += [f"{p}.self_attn.dense", f"{p}.mlp.fc2"]
    norms.append(("model.final_layernorm", ["lm_head"]))
    return LNPlan("phi", ["model.embed_tokens"], norms, writers, "lm_head")


PLANS = {"gpt2": _gpt2, "opt": _opt, "gpt_neox": _gpt_neox, "phi": _phi}


def plan_for(model) -> LNPlan:
    """The plan for ``model``, or RewriteRefused naming the architecture and why."""
    mt = getattr(model.config, "model_type", type(model).__name__)
    if mt not in PLANS:
        raise RewriteRefused(
            f"architecture {mt!r} ({type(model).__name__}) has no exact LayerNorm->RMSNorm plan; supported: "
            f"{', '.join(sorted(PLANS))}. Set approximate: true to swap its LayerNorms anyway (then heal)."
        )
    plan = PLANS[mt](model)
    names = dict(model.named_modules())
    missing = [n for n, _ in plan.norms if n not in names] + [n for n in plan.writers + plan.embeddings if n not in names]
    missing += [r for _, rs in plan.norms for r in rs if r not in names]
    if missing:
        raise RewriteRefused(f"{mt}: {type(model).__name__} lacks expected modules {missing[:5]}; not a causal-LM layout")
    planned = {n for n, _ in plan.norms}
    extra = sorted(n for n, m in names.items() if isinstance(m, nn.LayerNorm) and n not in planned)
    if extra:
        raise RewriteRefused(f"{mt}: LayerNorms outside the plan ({', '.join(extra[:5])}); not supported")
    return plan
