"""onnxruntime-genai's model builder, driven through its Python API, with its sharp edges owned.

The builder turns a Hugging Face folder into ONNX Runtime's fused decoder graph
(``GroupQueryAttention`` with rotary embedding, ``SkipSimplifiedLayerNormalization``, packed
QKV) plus the ``genai_config.json`` and tokenizer files that ``onnxruntime_genai.Model`` loads.
What it does not do for us, handled here:

- its CLI ``--help`` crashes (an argparse format bug), so it is called through
  ``parse_extra_options`` / ``create_model``, in-process, with its output captured and shown
  (last lines) in the error when it fails;
- it reads a few configs in pre-transformers-5 forms: Gemma-3's per-layer-type
  ``rope_parameters`` (it wants a flat dict and ``rope_local_base_freq``), and Mistral's /
  Phi-3's ``sliding_window`` only through ``layer_types`` (without them it silently builds
  full attention where eager slides) -- :func:`fix_config` rewrites the loaded config;
- sliding-window layers default to a window-sized ring cache that only its runtime drives; we
  build with ``windowed_kv_cache=false`` (a growing cache, the window applied by the kernel's
  ``local_window_size``), which both a plain ``InferenceSession`` and onnxruntime-genai run.

Which families go through it, and what it cannot build, is :func:`builder_problems`.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any, Callable

#: model_type -> the HF architecture the builder dispatches on (tested here with tiny models)
FUSED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
#: RoPE kinds the builder's graph matches eager for (checked here; it raises for llama3 and its
#: "linear" scaling differed from transformers 5's eager by whole logits on a tiny Llama)
ROPE_TYPES = ("default",)
#: families whose HF code slides every layer when ``sliding_window`` is set (no ``layer_types``)
_SLIDE_ALL_LAYERS = ("mistral", "phi3")


class BuilderError(RuntimeError):
    """The model builder failed; the message carries the cause and the tail of its output."""


def _rope_parameters(config: Any) -> list[dict]:
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        return list(rp.values())  # per-layer-type (Gemma-3 in transformers 5)
    return [rp] if isinstance(rp, dict) else []


#: ONNX Runtime's CPU GroupQueryAttention kernel takes only head sizes that are a multiple of this
GQA_HEAD_MULTIPLE = 16


def _head_dim(config: Any) -> int | None:
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
    return int(head_dim) if head_dim else None


def builder_problems(config: Any) -> list[str]:
    """Why the fused graph cannot be built for ``config`` ([] = it can)."""
    mtype = getattr(config, "model_type", None)
    if mtype not in FUSED_ARCHITECTURES:
        return [f"model_type {mtype!r} has no fused ONNX Runtime graph; supported: {', '.join(FUSED_ARCHITECTURES)}"]
    problems = []
    archs = getattr(config, "architectures", None) or [FUSED_ARCHITECTURES[mtype]]
    if archs[0] != FUSED_ARCHITECTURES[mtype]:
        problems.append(f"architecture {archs[0]} is not the causal LM the fused graph builds "
                        f"({FUSED_ARCHITECTURES[mtype]})")
    head_dim = _head_dim(config)
    if head_dim is not None and head_dim % GQA_HEAD_MULTIPLE:
        problems.append(f"head_dim {head_dim} is not a multiple of {GQA_HEAD_MULTIPLE}: ONNX Runtime's "
                        "GroupQueryAttention refuses it on the CPU (\"head_size shall be a multiple of 16\")")
    for rp in _rope_parameters(config):
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind not in ROPE_TYPES:
            problems.append(f"RoPE type {kind!r} is not built by onnxruntime-genai's model builder "
                            f"(supported: {', '.join(ROPE_TYPES)})")
    return problems


def fix_config(config: Any) -> None:
    """Rewrite a loaded transformers config into the forms the builder reads (see module doc)."""
    mtype = getattr(config, "model_type", None)
    if not getattr(config, "architectures", None) and mtype in FUSED_ARCHITECTURES:
        # a config without ``architectures`` (a GGUF conversion, a config built in code) is the causal LM
        # that builder_problems already assumed; the builder indexes the list unguarded
        config.architectures = [FUSED_ARCHITECTURES[mtype]]
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "full_attention" in rp and isinstance(rp["full_attention"], dict):
        full, local = dict(rp["full_attention"]), dict(rp.get("sliding_attention") or rp["full_attention"])
        config.rope_parameters = full
        config.rope_theta = full.get("rope_theta", 10000.0)
        config.rope_local_base_freq = local.get("rope_theta", config.rope_theta)
    if mtype in _SLIDE_ALL_LAYERS and getattr(config, "sliding_window", None) and not getattr(config, "layer_types", None):
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    if mtype == "phi3":
        # without LongRoPE (refused above) eager Phi-3 uses plain RoPE whatever its original
        # length says; the builder picks its LongRoPE class when the two lengths differ
        config.original_max_position_embeddings = config.max_position_embeddings


def build(hf_dir: Path, out_dir: Path, *, precision: str = "fp32", extra_options: dict[str, Any] | None = None,
          log: Callable[[str], None] = print) -> str:
    """Build ``hf_dir`` into ``out_dir`` (``model.onnx`` + data, ``genai_config.json``,
    tokenizer files) for the CPU execution provider; returns the builder's captured output."""
    import onnxruntime_genai.models.builder as builder_mod  # adds the builder's folder to sys.path

    opts = {"windowed_kv_cache": "false", "hf_remote": "false", **(extra_options or {})}
    kv = [f"{k}={v}" for k, v in opts.items()]
    out = io.StringIO()
    original = builder_mod.get_hf_details

    def get_hf_details(*args, **kwargs):
        details = original(*args, **kwargs)
        fix_config(details["hf_config"])
        return details

    with tempfile.TemporaryDirectory(prefix="ort-genai-cache.") as cache:
        builder_mod.get_hf_details = get_hf_details
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                parsed = builder_mod.parse_extra_options(None, str(hf_dir), str(out_dir), precision, "cpu", cache, kv)
                builder_mod.create_model(None, str(hf_dir), str(out_dir), precision, "cpu", cache, **parsed)
        except Exception as exc:
            tail = "\n".join(out.getvalue().strip().splitlines()[-15:])
            raise BuilderError(f"onnxruntime-genai model builder failed ({precision}, cpu): "
                               f"{type(exc).__name__}: {exc}\n--- builder output (last lines) ---\n{tail}") from exc
        finally:
            builder_mod.get_hf_details = original
    if not (Path(out_dir) / "model.onnx").is_file():
        raise BuilderError(f"onnxruntime-genai model builder wrote no model.onnx in {out_dir}:\n{out.getvalue()[-2000:]}")
    drop_load_arguments(Path(out_dir) / "tokenizer_config.json")
    return out.getvalue()


#: arguments of the builder's own ``AutoTokenizer.from_pretrained`` that transformers echoes into
#: the tokenizer_config.json it saves: how that process loaded the tokenizer, not the tokenizer
LOAD_ARGUMENTS = ("local_files_only",)


def drop_load_arguments(path: Path) -> None:
    """Remove :data:`LOAD_ARGUMENTS` from a saved tokenizer_config.json. The builder loads the
    tokenizer without ``local_files_only``, and transformers turns it on where the process started
    with ``HF_HUB_OFFLINE=1``: the same model exported in two environments differed in this one
    key, so its manifest's sha256 did too (seen between a test worker and its child process)."""
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    if any(k in data for k in LOAD_ARGUMENTS):
        path.write_text(json.dumps({k: v for k, v in data.items() if k not in LOAD_ARGUMENTS}, indent=2,
                                   ensure_ascii=False) + "\n")
