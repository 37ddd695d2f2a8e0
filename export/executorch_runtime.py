"""Run an ExecuTorch ``.pte`` written by :mod:`export.executorch` as a :class:`Runner`.

The program holds a static KV cache of ``max_seq_len`` positions inside its mutable buffers,
and its ``forward(tokens, input_pos)`` writes the cache at ``input_pos`` and returns logits
for every fed position. The runner keeps the position on the Python side: ``reset()`` only
sets it back to 0, because the next call at position 0 overwrites what the mask lets it see.
"""

from __future__ import annotations

from pathlib import Path

import torch

from export.runtime import Runner, RunnerError

#: metadata methods the exporter writes; read back here (TorchChat / ExecuTorch runners read them too)
META_METHODS = (
    "get_max_seq_len",
    "get_max_context_len",
    "get_max_prefill_chunk",
    "get_vocab_size",
    "get_bos_id",
    "get_eos_ids",
    "use_kv_cache",
    "enable_dynamic_shape",
    "tokenizer_type",
)


def set_threads(n: int) -> int:
    """Resize ExecuTorch's process-wide threadpool (XNNPACK uses it); returns the new count."""
    from executorch.extension.pybindings import portable_lib

    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    portable_lib._unsafe_reset_threadpool(int(n))
    return portable_lib._threadpool_get_thread_count()


def thread_count() -> int | None:
    try:
        from executorch.extension.pybindings import portable_lib

        return int(portable_lib._threadpool_get_thread_count())
    except Exception:  # pragma: no cover - older builds without the binding
        return None


class ExecuTorchRunner(Runner):
    """A ``.pte`` with a static KV cache, driven through ``executorch.runtime``."""

    runtime = "executorch"

    def __init__(self, path: str | Path, *, threads: int | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise RunnerError(f"ExecuTorch program {self.path} does not exist")
        # Kernels for quantized embeddings (quantized_decomposed::embedding_byte/4bit) must be
        # registered before a program that uses them is loaded.
        import executorch.kernels.quantized  # noqa: F401
        from executorch.runtime import Runtime

        if threads is not None:
            set_threads(threads)
        try:
            self._program = Runtime.get().load_program(self.path)
        except Exception as exc:
            raise RunnerError(
                f"cannot load ExecuTorch program {self.path} ({self.path.stat().st_size} bytes): {exc}. "
                "The file is truncated, corrupted or not a .pte; export it again."
            ) from None
        names = set(self._program.method_names)
        if "forward" not in names:
            raise RunnerError(f"{self.path} has no 'forward' method (methods: {', '.join(sorted(names))})")
        meta = {}
        for name in META_METHODS:
            if name in names:
                try:
                    value = self._program.load_method(name).execute([])
                except Exception as exc:
                    raise RunnerError(f"cannot read metadata {name!r} from {self.path}: {exc}") from None
                meta[name] = list(value) if name == "get_eos_ids" else value[0]
        if "get_max_seq_len" not in meta:
            raise RunnerError(
                f"{self.path} has no get_max_seq_len method; it was not written by the edge-optimize "
                "ExecuTorch exporter (a KV-cache program needs its cache length)"
            )
        self.meta = meta
        self.max_seq_len = int(meta["get_max_seq_len"])
        # A dynamic sequence dim bounded by max_seq_len accepts at most max_seq_len - 1 tokens.
        self.max_chunk = int(meta.get("get_max_prefill_chunk", self.max_seq_len - 1))
        self.vocab_size = meta.get("get_vocab_size")
        try:
            self._method = self._program.load_method("forward")
        except Exception as exc:
            raise RunnerError(f"cannot load method 'forward' of {self.path}: {exc}") from None
        self._pos = 0

    def reset(self) -> None:
        self._pos = 0

    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        t = int(ids.numel())
        if t == 0:
            raise RunnerError("forward needs at least one token")
        if self._pos + t > self.max_seq_len:
            raise RunnerError(
                f"{self.path.name}: {self._pos} cached + {t} new tokens exceed max_seq_len={self.max_seq_len}; "
                "call reset() or export with a larger max_seq_len"
            )
        outs = []
        for start in range(0, t, self.max_chunk):
            chunk = ids[start : start + self.max_chunk]
            n = int(chunk.numel())
            pos = torch.arange(self._pos, self._pos + n, dtype=torch.long)
            try:
                logits = self._method.execute([chunk.reshape(1, n), pos])[0]
            except Exception as exc:
                raise RunnerError(f"{self.path.name}: forward at position {self._pos} failed: {exc}") from None
            self._pos += n
            logits = logits.reshape(n, -1)
            outs.append(logits if all_logits else logits[-1:])
        out = torch.cat(outs, 0) if all_logits else outs[-1]
        return out.float()

    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def describe(self) -> dict:
        return {
            "runtime": self.runtime,
            "artifact": str(self.path),
            "max_seq_len": self.max_seq_len,
            "max_prefill_chunk": self.max_chunk,
            "threads": thread_count(),
            "methods": sorted(self._program.method_names),
            "metadata": self.meta,
        }
