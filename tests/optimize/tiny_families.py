"""Tiny random models of the families the equalization folds support, with norms moved away
from their init so a wrong fold shows (test helper; ``tests/optimize`` is on ``sys.path``
through its conftest). Configs come from the shared ``tests/conftest.py: TINY_CONFIGS``."""

from __future__ import annotations

import torch

#: the decoder families smoothquant/awq fold into (optimize.quant.fold_layouts.LAYOUTS)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
#: a small vocabulary keeps the logits cheap (the shared configs use SmolLM2's 49152)
VOCAB = 512


def family(model_type: str, **over) -> torch.nn.Module:
    """A tiny random model whose norms are far from their init (Gemma's ``w`` around 0, so the
    norm scale ``1 + w`` is around 1; the others around 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import TINY_CONFIGS

    kw = {**TINY_CONFIGS[model_type], "vocab_size": VOCAB, "pad_token_id": 0, "max_position_embeddings": 128, **over}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if model_type.startswith("gemma") else 1.0))
    return model.eval()
