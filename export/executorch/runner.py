"""Run an ExecuTorch ``.pte`` written by :mod:`export.executorch.exporter` as a :class:`Runner`.

The program holds a static KV cache of ``max_seq_len`` positions inside its mutable buffers,
and its ``forward(tokens, input_pos)`` writes the cache at ``input_pos`` and returns logits.
The runner keeps the position on the Python side: ``reset()`` only sets it back to 0, because
the next call at position 0 overwrites what the mask lets it see.

What a call may hold is read from the program itself, as ExecuTorch's C++ runner does: the
largest chunk is the smaller of ``get_max_prefill_chunk`` and the token input's upper bound;
``input_pos`` is a range of positions when that input holds more than one element, else the
start position; a program that returns only the last position's logits is fed one token at a
time when every position is asked for. :meth:`ExecuTorchRunner.llm_runner_report` runs the
same program through ExecuTorch's C++ text runner (:mod:`export.executorch.llm_runner`).
"""

from __future__ import annotations

import copy
import logging
import mmap
from pathlib import Path

import torch

from export.executorch.blas_threads import require_serial_mkl, serial_torch
from export.decoding.runtime import Runner, RunnerError, first_divergence, greedy_generate

log = logging.getLogger(__name__)

#: metadata methods the exporter writes; read back here (TorchChat / ExecuTorch runners read them too)
META_METHODS = (
    "get_max_seq_len",
    "get_max_context_len",
    "get_max_prefill_chunk",
    "get_vocab_size",
    "get_bos_id",
    "get_eos_ids",
    "get_draft_vocab",
    "use_kv_cache",
    "enable_dynamic_shape",
    "tokenizer_type",
    "sliding_window",  # the shortest window, where a layer keeps a ring cache
)

#: the extra method the exporter's ``scoring_method`` adds: forward over the same weights returning
#: every fed position's logits, so lm-eval scoring of a ``logits: last`` program feeds a continuation
#: in one call
SCORING_METHOD = "forward_all"
#: the method the exporter's ``verify_tokens`` adds: up to that many tokens a call, every position's
#: logits equal to one-token ``forward`` calls', on ``forward``'s own KV cache (speculative decoding)
VERIFY_METHOD = "verify"
#: the method the pipeline's draft block adds: a draft model with its own KV cache (export/executorch/draft.py)
DRAFT_METHOD = "draft"
#: metadata methods whose value is a list
LIST_META = ("get_eos_ids", "get_draft_vocab")


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


def uses_llama_custom_ops(path: Path) -> bool:
    """Whether the program names ExecuTorch's LLM custom ops (``llama::custom_sdpa``, ``llama::update_cache``...);
    their kernels register only when ``executorch.extension.llm.custom_ops`` is imported (seconds), so
    programs without them skip it."""
    if path.stat().st_size == 0:  # mmap refuses empty files; loading will say what is wrong
        return False
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(b"llama::") >= 0


def load_llama_custom_ops() -> None:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401


class ExecuTorchRunner(Runner):
    """A ``.pte`` with a static KV cache, driven through ``executorch.runtime``."""

    runtime = "executorch"

    def __init__(self, path: str | Path, *, threads: int | None = None, method: str = "forward"):
        self.path = Path(path)
        if not self.path.is_file():
            raise RunnerError(f"ExecuTorch program {self.path} does not exist")
        # Kernels for quantized embeddings (quantized_decomposed::embedding_byte/4bit) must be
        # registered before a program that uses them is loaded.
        import executorch.kernels.quantized  # noqa: F401
        from executorch.runtime import Runtime

        if uses_llama_custom_ops(self.path):
            load_llama_custom_ops()
            require_serial_mkl()

        if threads is not None:
            set_threads(threads)
        try:
            # a program exported with weights: external keeps them in model.ptd beside it
            ptd = self.path.with_suffix(".ptd")
            self._program = Runtime.get().load_program(self.path, data_path=ptd if ptd.is_file() else None)
        except Exception as exc:
            raise RunnerError(
                f"cannot load ExecuTorch program {self.path} ({self.path.stat().st_size} bytes): {exc}. "
                "The file is truncated, corrupted or not a .pte; export it again."
            ) from None
        names = set(self._program.method_names)
        if method not in names:
            raise RunnerError(f"{self.path} has no {method!r} method (methods: {', '.join(sorted(names))})")
        meta = {}
        for name in META_METHODS:
            if name in names:
                try:
                    value = self._program.load_method(name).execute([])
                except Exception as exc:
                    raise RunnerError(f"cannot read metadata {name!r} from {self.path}: {exc}") from None
                meta[name] = list(value) if name in LIST_META else value[0]
        if "get_max_seq_len" not in meta:
            raise RunnerError(
                f"{self.path} has no get_max_seq_len method; it was not written by the edge-optimize "
                "ExecuTorch exporter (a KV-cache program needs its cache length)"
            )
        self.meta = meta
        # KV-cache positions: get_max_context_len (ExecuTorch's convention, where get_max_seq_len is
        # the most tokens one call takes); older programs wrote only get_max_seq_len
        self.max_seq_len = int(meta.get("get_max_context_len", meta["get_max_seq_len"]))
        self.vocab_size = meta.get("get_vocab_size")
        self._bind(method)
        self._pos = 0
        self._llm = None
        #: the verify method, bound by speculative_runner(): several tokens a call, one-token logits
        self._verify = None

    def _bind(self, method: str) -> None:
        """Load ``method`` (a KV-cache forward: ``forward``, or the exporter's ``forward_all``) and read
        what one call of it takes and returns."""
        meta = self.meta
        try:
            self._method = self._program.load_method(method)
        except Exception as exc:
            raise RunnerError(f"cannot load method {method!r} of {self.path}: {exc}") from None
        self.method = method
        fmeta = self._method.metadata
        self._forward_inputs = fmeta.num_inputs()
        if self._forward_inputs != 2:
            raise RunnerError(f"{self.path.name}: forward takes {self._forward_inputs} inputs; a KV-cache program "
                              "takes (tokens[1, T], input_pos)")
        tokens_max = int(fmeta.input_tensor_meta(0).sizes()[-1])
        # A dynamic sequence dim bounded by max_seq_len accepts at most max_seq_len - 1 tokens.
        self.max_chunk = max(1, min(int(meta.get("get_max_prefill_chunk", self.max_seq_len - 1)), tokens_max))
        #: input_pos as positions [T] (transformers' cache_position) or as the start [1] (ExecuTorch's llama)
        self._pos_is_range = int(fmeta.input_tensor_meta(1).sizes()[0]) > 1
        out_sizes = fmeta.output_tensor_meta(0).sizes()
        #: whether forward returns logits for every fed position or only for the last one
        self.all_positions = len(out_sizes) < 3 or int(out_sizes[-2]) > 1 or self.max_chunk == 1

    def reset(self) -> None:
        self._pos = 0

    def truncate(self, n: int) -> bool:
        """Continue from position ``n``: exact, since the program's mask hides every cache slot at or
        after the fed positions. A ring (sliding-window) cache overwrites slots of earlier positions,
        so a program with one answers False."""
        if not 0 < n <= self._pos:
            return super().truncate(n)
        window = self.meta.get("sliding_window")
        if window is not None and int(window) < self.max_seq_len:
            return False
        self._pos = n
        return True

    def scoring_runner(self) -> "ExecuTorchRunner":
        """A runner over the exporter's ``forward_all`` method (every position's logits, same weights)
        when this one returns only the last position and the program has it; else this runner.
        Loading the method packs XNNPACK's weights a second time."""
        if self.all_positions or SCORING_METHOD not in self._program.method_names:
            return self
        other = copy.copy(self)
        other._llm = None
        other._bind(SCORING_METHOD)
        other.reset()
        return other

    def speculative_runner(self) -> "ExecuTorchRunner":
        """This program with its ``verify`` method bound beside ``forward``, on the same KV cache: a call
        of 2 to ``verify_tokens`` tokens that asks for every position goes through ``verify``, whose logits
        are bit for bit what ``forward`` gives one token a call; everything else through ``forward``.
        Refused for a program exported without ``verify_tokens``. Loading the method packs XNNPACK's
        weights a second time."""
        if self._verify is not None:
            return self
        names = set(self._program.method_names)
        if VERIFY_METHOD not in names:
            raise RunnerError(f"{self.path.name} has no {VERIFY_METHOD!r} method (methods: {', '.join(sorted(names))}); "
                              "export it with export.executorch.verify_tokens (for example 5) to decode speculatively")
        if self.method != "forward":
            raise RunnerError(f"speculative decoding continues forward's cache; this runner is bound to {self.method!r}")
        try:
            verify = self._program.load_method(VERIFY_METHOD)
        except Exception as exc:
            raise RunnerError(f"cannot load method {VERIFY_METHOD!r} of {self.path}: {exc}") from None
        other = copy.copy(self)
        other._llm = None
        other._verify = verify
        other.verify_tokens = int(verify.metadata.input_tensor_meta(0).sizes()[-1])
        other.reset()
        return other

    def draft_runner(self) -> "ExecuTorchRunner":
        """A runner over the program's ``draft`` method: the draft model the pipeline's ``draft`` block made,
        with a KV cache of its own (prefill and one-token steps, last position's logits over its head's
        vocabulary: ``draft_vocab`` maps a partial one back to token ids). Refused for a program without it."""
        names = set(self._program.method_names)
        if DRAFT_METHOD not in names:
            raise RunnerError(f"{self.path.name} has no {DRAFT_METHOD!r} method (methods: {', '.join(sorted(names))}); "
                              "export it with the pipeline's draft block to decode with a draft model")
        other = copy.copy(self)
        other._llm, other._verify, other.verify_tokens, other.draft_policy = None, None, None, None
        other._bind(DRAFT_METHOD)
        other.reset()
        return other

    @property
    def draft_vocab(self) -> list[int] | None:
        """The draft head's row -> token id (None: the whole vocabulary, or no draft)."""
        return self.meta.get("get_draft_vocab")

    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        ids = self.checked_ids(ids)
        t = int(ids.numel())
        # a draft of 2..verify_tokens tokens goes through verify in one call (every position, one-token logits)
        verifying = self._verify is not None and all_logits and 1 < t <= self.verify_tokens
        method, name = (self._verify, VERIFY_METHOD) if verifying else (self._method, "forward")
        # a last-position-only program scores every position only when fed one token at a time
        step = t if verifying else self.max_chunk if (self.all_positions or not all_logits) else 1
        outs = []
        with serial_torch():  # export/executorch/blas_threads.py: MKL must not thread inside custom_sdpa
            for start in range(0, t, step):
                chunk = ids[start : start + step]
                n = int(chunk.numel())
                pos = (torch.arange(self._pos, self._pos + n, dtype=torch.long) if self._pos_is_range
                       else torch.tensor([self._pos], dtype=torch.long))
                try:
                    logits = method.execute([chunk.reshape(1, n), pos])[0]
                except Exception as exc:
                    raise RunnerError(f"{self.path.name}: {name} of {n} tokens at position {self._pos} failed: {exc}") from None
                self._pos += n
                logits = logits.reshape(-1, logits.shape[-1])
                # the last row copied: a view would keep each call's positions x vocab logits alive
                outs.append(logits if all_logits else logits[-1:].clone())
                if not all_logits:
                    del outs[:-1]
        # one chunk (a whole window's prefill) is returned as it is: no copy of positions x vocab logits
        out = (torch.cat(outs, 0) if len(outs) > 1 else outs[0]) if all_logits else outs[-1]
        return out.float()

    def size_bytes(self) -> int:
        ptd = self.path.with_suffix(".ptd")  # external weights, when the program has them
        return self.path.stat().st_size + (ptd.stat().st_size if ptd.is_file() else 0)

    def describe(self) -> dict:
        reason = self.llm_runner_unavailable()
        return {
            "runtime": self.runtime,
            "artifact": str(self.path),
            "max_seq_len": self.max_seq_len,
            "max_prefill_chunk": self.max_chunk,
            "input_pos": "positions" if self._pos_is_range else "start",
            "method": self.method,
            "all_position_logits": self.all_positions,
            "threads": thread_count(),
            "methods": sorted(self._program.method_names),
            "metadata": self.meta,
            "llm_runner": {"usable": reason is None, **({"reason": reason} if reason else {})},
        }

    # -- ExecuTorch's C++ text runner over the same file -----------------------------------------

    def llm_runner_unavailable(self) -> str | None:
        """Why ExecuTorch's C++ ``TextLLMRunner`` cannot run this program (None if it can)."""
        from export.executorch.llm_runner import tokenizer_file, unavailable_reason

        return unavailable_reason(sorted(self._program.method_names), self._forward_inputs,
                                  tokenizer_file(self.path.parent))

    def llm_runner(self):
        """The C++ runner over this file and the tokenizer beside it (built once); raises
        :class:`~export.executorch.llm_runner.LLMRunnerUnavailable` with the reason."""
        from export.executorch.llm_runner import LLMRunnerUnavailable, NativeLLMRunner, tokenizer_file

        if self._llm is None:
            reason = self.llm_runner_unavailable()
            if reason:
                raise LLMRunnerUnavailable(reason)
            self._llm = NativeLLMRunner(self.path, tokenizer_file(self.path.parent),
                                        eos_ids=self.meta.get("get_eos_ids", []),
                                        max_context_len=int(self.meta.get("get_max_context_len", self.max_seq_len)))
        return self._llm

    def llm_runner_report(self, prompt_ids, tokenizer, *, greedy_tokens: int = 16, decode_tokens: int = 32,
                          runs: int = 3, warmup: int = 1) -> dict:
        """ExecuTorch's C++ text runner on ``prompt_ids``: its greedy tokens against this Python loop's
        (``greedy``) and its own Stats, median of ``runs`` after ``warmup`` (``stats``: prefill ms and
        tok/s, decode tok/s, time to first token). ``tokenizer`` (transformers) turns the ids into the
        text the runner takes; the C++ tokenizer must give back the same ids.

        Never raises for an unusable runner: returns ``{"used": False, "reason": ...}`` (and logs it)."""
        from export.executorch.llm_runner import LLMRunnerUnavailable

        prompt = [int(i) for i in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
        room = self.max_seq_len - len(prompt) - 1
        try:
            llm = self.llm_runner()
            # The reference is this loop on the ids the C++ tokenizer made of the text, so the check holds
            # even where the two tokenizers split a mid-document excerpt differently.
            text, num_bos = llm.prompt_for(tokenizer, prompt[: max(1, min(32, len(prompt)))], strict=False)
            gen = llm.generate(text, max(1, min(greedy_tokens, self.max_seq_len - len(llm.encode(text, num_bos)) - 1)),
                               num_bos=num_bos)
            ref = greedy_generate(self, gen.prompt_ids, len(gen.ids), eos_token_ids=self.meta.get("get_eos_ids", []))
            diverged = first_divergence(gen.ids, ref)
            text, num_bos = llm.prompt_for(tokenizer, prompt, strict=False)
            stats = llm.timed(text, max(1, min(decode_tokens, room)), num_bos=num_bos, runs=runs, warmup=warmup)
        except (LLMRunnerUnavailable, RunnerError) as exc:  # e.g. a prompt the cache cannot hold
            log.warning("%s: ExecuTorch's C++ LLM runner not used: %s", self.path.name, exc)
            return {"used": False, "reason": str(exc)}
        finally:
            self.reset()
        return {
            "used": True,
            "tokenizer": llm.tokenizer_path.name,
            "greedy": {"tokens": len(gen.ids), "match": diverged is None, "diverged_at": diverged,
                       "llm_runner_ids": gen.ids, "python_loop_ids": ref, "llm_runner_text": gen.text},
            "stats": {**stats, "threads": thread_count()},
        }
