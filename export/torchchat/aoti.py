"""AOTInductor: a decoder-only HF LM as a ``.pt2`` package with TorchChat's forward signature.

TorchChat's desktop path calls ``torch._inductor.aoti_load_package(path)`` and then
``model(tokens, input_pos)`` for every token: ``tokens`` is ``int32 [1, T]`` and ``input_pos``
``int32 [T]`` in its Python ``generate`` (its own ``export`` traces with ``torch.int``), and its
C++ runner reads ``tokenizer_type`` and ``AOTI_DEVICE_KEY`` from the package metadata. The
package here has that signature, a static KV cache inside (mutated buffers), a dynamic
sequence length up to ``max_seq_len``, and those metadata keys.

AOTInductor does not check input dtypes at run time: an int64 tensor passed to an int32
program is read as int32 pairs. :class:`AOTIRunner` always passes int32.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export.base import ExportError
from export.decoding.runtime import Runner, RunnerError

#: metadata the runner needs besides TorchChat's own keys (all values are strings in AOTI)
META_KEYS = ("tokenizer_type", "get_max_seq_len", "get_vocab_size", "get_bos_id", "get_eos_ids")


class _TorchChatSignature(nn.Module):
    """``forward(tokens: int32 [1, T], input_pos: int32 [T]) -> logits [1, T, vocab]``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens.to(torch.long), cache_position=input_pos.to(torch.long))


def compile_package(model: nn.Module, path: Path, *, max_seq_len: int, metadata: dict[str, Any], log=print) -> dict:
    """Export ``model`` with a static cache of ``max_seq_len`` and compile it into ``path``.

    Quantized torchao weights stay quantized (the graph keeps their dequantize ops). Returns
    details for the report (timings, the metadata written).
    """
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    config = getattr(model, "config", None)
    if config is None:
        raise ExportError("the AOTInductor package is built from a Hugging Face causal LM (a PreTrainedModel)")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_seq_len > limit:
        raise ExportError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={limit}")
    model = copy.deepcopy(model).eval()  # the static-cache wrapper rewrites generation_config
    model.config.use_cache = True
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    wrapper = _TorchChatSignature(TorchExportableModuleWithStaticCache(model, 1, max_seq_len)).eval()
    seq = torch.export.Dim("seq", min=1, max=max_seq_len)
    example = (torch.zeros(1, 4, dtype=torch.int32), torch.arange(4, dtype=torch.int32))
    timings = {}
    t0 = time.perf_counter()
    log(f"aoti: torch.export (max_seq_len={max_seq_len}, int32 tokens/input_pos as torchchat passes them)")
    try:
        with torch.no_grad():
            ep = torch.export.export(wrapper, example, dynamic_shapes={"tokens": {1: seq}, "input_pos": {0: seq}},
                                     strict=True)
    except Exception as exc:
        raise ExportError(f"torch.export of {type(model).__name__} for AOTInductor failed: {exc}") from exc
    timings["torch_export_s"] = time.perf_counter() - t0
    meta = {str(k): str(v) for k, v in metadata.items()}
    log("aoti: compiling with AOTInductor (C++ compiler; about a minute for a full-size model)")
    t0 = time.perf_counter()
    try:
        out = torch._inductor.aoti_compile_and_package(
            ep, package_path=str(path), inductor_configs={"aot_inductor.metadata": meta}
        )
    except Exception as exc:
        raise ExportError(f"AOTInductor compilation failed: {exc}") from exc
    timings["compile_s"] = time.perf_counter() - t0
    if Path(out) != Path(path):
        raise ExportError(f"AOTInductor wrote {out}, not {path}")
    return {"timings": timings, "metadata": meta}


class AOTIRunner(Runner):
    """A ``.pt2`` written by :func:`compile_package`, driven exactly as TorchChat drives it."""

    runtime = "aoti"

    def __init__(self, path: str | Path, *, threads: int | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise RunnerError(f"AOTInductor package {self.path} does not exist")
        if threads is not None:
            torch.set_num_threads(int(threads))
        try:
            self._model = torch._inductor.aoti_load_package(str(self.path))
            self.meta = dict(self._model.get_metadata())
        except Exception as exc:
            raise RunnerError(
                f"cannot load AOTInductor package {self.path} ({self.path.stat().st_size} bytes): {exc}. "
                "It was compiled for another CPU/platform, or the file is damaged; export it again."
            ) from None
        if "get_max_seq_len" not in self.meta:
            raise RunnerError(f"{self.path} has no get_max_seq_len metadata; it was not written by edge-optimize")
        self.max_seq_len = int(self.meta["get_max_seq_len"])
        self.vocab_size = int(self.meta["get_vocab_size"]) if "get_vocab_size" in self.meta else None
        self._pos = 0

    def reset(self) -> None:
        self._pos = 0  # the next call at position 0 overwrites what the mask lets it see

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        ids = self.checked_ids(ids).to(torch.int32)
        t = int(ids.numel())
        pos = torch.arange(self._pos, self._pos + t, dtype=torch.int32)
        try:
            logits = self._model(ids[None], pos)
        except Exception as exc:
            raise RunnerError(f"{self.path.name}: forward at position {self._pos} failed: {exc}") from None
        self._pos += t
        logits = logits.reshape(t, -1)
        return (logits if all_logits else logits[-1:]).float()

    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def describe(self) -> dict:
        return {"runtime": self.runtime, "artifact": str(self.path), "max_seq_len": self.max_seq_len,
                "threads": torch.get_num_threads(), "metadata": self.meta}
