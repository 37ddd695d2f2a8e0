"""Is this model really a causal LM? Refuse what is not, before anyone measures it.

``AutoModelForCausalLM`` loads more than causal LMs: an HF folder holding a BERT sentence
encoder comes back as ``BertLMHeadModel`` with a randomly initialised head and bidirectional
attention. It runs, scores a meaningless perplexity, quantizes, and fails only at export.
Three checks, from cheapest to most certain:

- :func:`config_problem`: what the config alone shows (no causal-LM class for the model type,
  ``architectures`` naming no causal-LM head, an encoder family's ``is_decoder`` left false);
- :func:`missing_weights_problem`: transformers built tensors the checkpoint lacks (its own
  ``output_loading_info``), i.e. a head or layers that would be random;
- :func:`causality_problem`: a forward probe; changing the last token must not move the
  logits of earlier positions.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

#: suffixes transformers gives its causal-LM classes
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def _causal_class_names() -> dict[str, str]:
    """model_type -> the class ``AutoModelForCausalLM`` builds for it (transformers' own table)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        out[model_type] = names[0] if isinstance(names, (tuple, list)) else names
    return out


def _is_causal_name(name: str, known: Iterable[str]) -> bool:
    return name in set(known) or name.endswith(_CAUSAL_SUFFIXES)


def _needs_is_decoder(class_name: str) -> bool:
    """True for encoder families (BERT, RoBERTa, ELECTRA...) whose causal-LM class attends
    causally only when ``config.is_decoder`` is set: its constructor says so by reading it."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        return False
    try:
        return "is_decoder" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


#: size fields every check downstream relies on, and the largest plausible value of each (far
#: above any real model: 128 heads, 256k vocabularies, 1M positions). transformers accepts any
#: value; a typo like num_key_value_heads: 2147483648 would otherwise hang a check that loops
#: over heads or ask for terabytes.
SIZE_LIMITS = {
    "hidden_size": 2**20, "n_embd": 2**20, "intermediate_size": 2**22, "n_inner": 2**22, "ffn_dim": 2**22,
    "num_hidden_layers": 2**12, "n_layer": 2**12, "num_attention_heads": 2**12, "n_head": 2**12,
    "num_key_value_heads": 2**12, "head_dim": 2**16, "vocab_size": 2**24, "max_position_embeddings": 2**26,
    "n_positions": 2**26,
}


def size_problem(config: Any) -> str | None:
    """Sizes that are not positive integers within :data:`SIZE_LIMITS`, or heads that do not group."""
    bad = []
    for key, limit in SIZE_LIMITS.items():
        value = getattr(config, key, None) if key in getattr(config, "__dict__", {}) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            bad.append(f"{key}={value!r} (a positive integer up to {limit})")
    if bad:
        return "implausible sizes in the model config: " + ", ".join(bad)
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        return f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
    return None


def config_problem(config: Any) -> str | None:
    """Why ``config`` does not describe a causal LM that loads with its own weights, or None."""
    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:
        return None  # remote code declares its own causal-LM class
    model_type = getattr(config, "model_type", None)
    classes = _causal_class_names()
    if model_type not in classes:
        return (
            f"model_type {model_type!r} has no causal-LM class in transformers (an encoder, an encoder-decoder "
            "or a vision model?); only decoder-only causal language models can be optimized and exported"
        )
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not any(_is_causal_name(a, classes.values()) for a in archs):
        return (
            f"config.json's architectures {archs} name no causal-LM head (…ForCausalLM / …LMHeadModel): "
            f"loading it as {classes[model_type]} would add a randomly initialised head; this looks like an "
            "encoder or a base model saved without its language-model head"
        )
    if getattr(config, "is_decoder", None) is False and _needs_is_decoder(classes[model_type]):
        return (
            f"model_type {model_type!r} is an encoder (is_decoder: false, so its attention is bidirectional); "
            f"{classes[model_type]} is a causal LM only with is_decoder: true and weights trained that way"
        )
    return None


def missing_weights_problem(loading_info: dict, class_name: str, limit: int = 8) -> str | None:
    """Transformers' ``output_loading_info``: tensors it had to initialise are random."""
    missing = sorted(loading_info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in (loading_info.get("mismatched_keys") or []))
    if not missing and not mismatched:
        return None
    parts = []
    if missing:
        shown = ", ".join(missing[:limit]) + (f" … (+{len(missing) - limit} more)" if len(missing) > limit else "")
        parts.append(f"{len(missing)} tensor(s) missing from the checkpoint were newly initialised: {shown}")
    if mismatched:
        parts.append(f"{len(mismatched)} tensor(s) had the wrong shape: {', '.join(mismatched[:limit])}")
    return (
        f"transformers built {class_name} with random weights ({'; '.join(parts)}); the checkpoint holds no "
        "complete causal LM (an encoder, or a base model without its language-model head?)"
    )


@torch.no_grad()
def causality_problem(model: torch.nn.Module, tokens: int = 8, rtol: float = 1e-6) -> str | None:
    """Change the last token of a short probe: a causal LM's earlier logits must not move.

    They do not move at all in a causal model (the changed key gets exactly zero attention:
    measured 0.0 on eleven decoder families in fp32 and bf16), while a bidirectional one moves
    them by about 1e-3 even at random init; ``rtol`` (of the largest logit) sits far below that."""
    emb = model.get_input_embeddings()
    vocab = int(getattr(emb, "num_embeddings", 0) or getattr(model.config, "vocab_size", 0) or 2)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % vocab
    device = emb.weight.device if getattr(emb, "weight", None) is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        a = model(input_ids=ids.to(device)).logits[0, :-1].float()
        b = model(input_ids=changed.to(device)).logits[0, :-1].float()
    finally:
        model.train(was_training)
    moved = float((a - b).abs().max())
    if moved <= rtol * max(1.0, float(a.abs().max())):
        return None
    return (
        f"{type(model).__name__} is not causal: changing the last token of a {tokens}-token probe moved the "
        f"logits of earlier positions by {moved:.3g} (bidirectional attention, e.g. an encoder); perplexity "
        "and generation would be meaningless"
    )
