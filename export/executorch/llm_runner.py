"""ExecuTorch's C++ text LLM runner (``TextLLMRunner``, the runner Android and iOS apps link),
driven from Python, so what we verify and time is what an app ships.

The runner takes text, tokenizes it with the C++ tokenizer (``pytorch_tokenizers``: an HF
``tokenizer.json``, a SentencePiece ``tokenizer.model`` or a tiktoken file), prefills, samples,
and reports its own :class:`Stats`. It needs from the program: ``get_max_seq_len`` (required),
``get_max_context_len``, ``use_kv_cache``, ``enable_dynamic_shape`` and ``get_eos_ids``, and a
``forward(tokens[1, T], input_pos)`` whose second input is either a range of positions or the
start position (it reads the input's size to tell).

The sharp edges this module owns:

- the runner hands back decoded *text pieces*, not token ids, and its Python binding turns each
  piece into a ``str``: a piece that is part of a character (a byte-level BPE writes "わ" as two
  tokens, the first two of its three UTF-8 bytes and the last) raises ``UnicodeDecodeError`` inside
  the runner and ends the generation. So the runner is given a copy of the tokenizer without its
  decoder (:func:`piece_tokenizer`): the same encoding, and a piece that is the token's own
  spelling in the vocabulary ("ãĤ", "<0xE3>"), always valid UTF-8 and one token's alone. Ids are
  recovered from the pieces through that tokenizer's decode table, exactly; only a piece several
  ids give (special tokens) is ``None``, unless it is the EOS that ended generation. Text is the
  original tokenizer's decode of the ids (:meth:`NativeLLMRunner.decode`), streamed whole by
  :class:`export.decoding.text_stream.TextStream`;
- the C++ tokenizer may not encode a prompt as transformers does (BOS handling, special tokens):
  :meth:`NativeLLMRunner.prompt_for` finds the text/BOS setting that gives the same ids, or says
  why none does;
- the runner logs through ``ET_LOG`` to the process's stderr and ``printf``s tokens to stdout:
  generation runs with ``warming=True`` (which only silences the printing; stats are the same)
  and stderr captured, and a failure carries the runner's own last log lines. It still prints a
  newline when it stops at EOS; C stdio is flushed right after, so it lands where it belongs;
- its limits differ from the Python loop's at the edges: it stops when prompt + new tokens reach
  ``max_context_len`` (the loop would predict one more from the full cache), and it never
  EOS-checks the token that comes out of prefill.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from export.executorch.blas_threads import serial_torch

#: metadata methods TextLLMRunner reads (get_max_seq_len is required, the rest have defaults)
REQUIRED_METHODS = ("get_max_seq_len",)
READ_METHODS = ("get_max_seq_len", "get_max_context_len", "use_kv_cache", "enable_dynamic_shape", "get_eos_ids")
#: tokenizer files the C++ loader understands, in the order we look for them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class LLMRunnerUnavailable(RuntimeError):
    """The C++ runner cannot serve this program/tokenizer/prompt; the message says why."""


def tokenizer_file(directory: Path) -> Path | None:
    for name in TOKENIZER_FILES:
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def unavailable_reason(method_names: Sequence[str], forward_inputs: int, tokenizer: Path | None) -> str | None:
    """Why the C++ runner cannot run a program, from what the Python runtime already read; None if it can."""
    missing = [m for m in REQUIRED_METHODS if m not in method_names]
    if missing:
        return f"the program has no {', '.join(missing)} metadata method (TextLLMRunner requires it)"
    if forward_inputs != 2:
        return f"forward takes {forward_inputs} inputs; TextLLMRunner's KV-cache path feeds (tokens, input_pos)"
    if tokenizer is None:
        return f"no tokenizer file ({' or '.join(TOKENIZER_FILES)}) beside the program"
    try:
        with captured_stderr():  # importing the bindings logs a regex note from the C++ tokenizers
            import executorch.extension.llm.runner  # noqa: F401
            import pytorch_tokenizers  # noqa: F401
    except Exception as exc:  # pragma: no cover - a build without the LLM runner bindings
        return f"this executorch build has no LLM runner bindings ({exc})"
    return None


@contextlib.contextmanager
def captured_stderr() -> Iterator[Callable[[], str]]:
    """Send fd 2 (where ET_LOG writes) to a temp file; yields a function returning what was written."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)

        def text() -> str:
            tmp.flush()
            tmp.seek(0)
            return tmp.read().decode("utf-8", "replace")

        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _log_tail(log: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and "cpuinfo" not in ln]
    return " | ".join(lines[-n:])


def stats_dict(s) -> dict:
    """The runner's Stats as report figures (its clock has 1 ms resolution)."""
    prefill_ms = s.prompt_eval_end_ms - s.inference_start_ms
    decode_ms = s.inference_end_ms - s.prompt_eval_end_ms
    return {
        "prompt_tokens": int(s.num_prompt_tokens),
        "generated_tokens": int(s.num_generated_tokens),
        "prefill_ms": float(prefill_ms),
        "prefill_tok_s": s.num_prompt_tokens * 1000.0 / prefill_ms if prefill_ms > 0 else None,
        "decode_tok_s": s.num_generated_tokens * 1000.0 / decode_ms if decode_ms > 0 and s.num_generated_tokens else None,
        "ttft_ms": float(s.first_token_ms - s.inference_start_ms),
        "sampling_ms": float(s.aggregate_sampling_time_ms),
    }


def median_stats(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


@dataclass
class Generation:
    """One run of the C++ runner: recovered ids (None where a piece is ambiguous), the pieces it streamed
    (each token's spelling in the vocabulary), the text (the tokenizer's decode of the ids, special tokens
    written out), stats."""

    ids: list[int | None]
    pieces: list[str]
    stats: dict
    stopped_at_eos: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    text: str = ""


def piece_tokenizer(tokenizer: Path, out: Path) -> Path:
    """``out``/tokenizer.json: the tokenizer ``tokenizer`` (a ``tokenizer.json``, or a SentencePiece
    ``tokenizer.model`` that transformers converts) without its decoder, so the C++ runner streams each
    token's spelling in the vocabulary, valid UTF-8, and encodes exactly as before."""
    if tokenizer.suffix == ".json":
        data = json.loads(tokenizer.read_text(encoding="utf-8"))
    else:
        from transformers import AutoTokenizer

        try:
            fast = AutoTokenizer.from_pretrained(tokenizer.parent, local_files_only=True)
            data = json.loads(fast.backend_tokenizer.to_str())
        except Exception as exc:
            raise LLMRunnerUnavailable(f"{tokenizer.name} has no tokenizer.json beside it and transformers could "
                                       f"not convert it ({type(exc).__name__}: {exc})") from None
    data["decoder"] = None
    path = Path(out) / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


class NativeLLMRunner:
    """``TextLLMRunner`` over a ``.pte`` and its tokenizer file, with ids recovered from pieces."""

    def __init__(self, pte: str | Path, tokenizer: str | Path, eos_ids: Sequence[int] = (),
                 max_context_len: int | None = None):
        from executorch.extension.llm.runner import TextLLMRunner

        self.pte, self.tokenizer_path = Path(pte), Path(tokenizer)
        # the original decodes text; the runner and the piece index read the copy without a decoder, which both
        # load in their constructors
        self._text_tok = _text_tokenizer(self.tokenizer_path)
        with tempfile.TemporaryDirectory(prefix="optimize-llm-tokenizer-") as tmp:
            pieces = piece_tokenizer(self.tokenizer_path, Path(tmp))
            self._tok = _load_cpp_tokenizer(pieces)  # refuses what the C++ tokenizer cannot read (a Lowercase normalizer)
            with captured_stderr() as log:
                try:
                    self._runner = TextLLMRunner(str(self.pte), str(pieces))
                except Exception as exc:
                    raise LLMRunnerUnavailable(f"TextLLMRunner could not load {self.pte.name}: {exc} "
                                               f"({_log_tail(log())})") from None
        self.eos_ids = {int(e) for e in eos_ids if int(e) >= 0}
        self.max_context_len = max_context_len
        self._pieces: dict[str, list[int]] | None = None

    # -- tokenizer ---------------------------------------------------------------------------

    def encode(self, text: str, num_bos: int = 0) -> list[int]:
        return [int(i) for i in self._tok.encode(text, num_bos, 0)]

    def decode(self, ids: Sequence[int | None], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` as the tokenizer beside the program decodes it (None ids left out)."""
        return self._text_tok.decode([int(i) for i in ids if i is not None], skip_special_tokens=skip_special_tokens)

    def prompt_for(self, hf_tokenizer, ids: Sequence[int], *, text: str | None = None,
                   strict: bool = True) -> tuple[str, int]:
        """Text and ``num_bos`` for which the C++ tokenizer gives exactly ``ids``.

        Tries ``text`` (the user's prompt) and the decoded ids (special tokens written out) with no
        BOS, then, if ``ids`` start with the BOS, each without it and ``num_bos=1``. If none matches:
        raises, or with ``strict=False`` returns the decoded text (for timing, where a token more or
        less does not matter)."""
        ids = [int(i) for i in ids]
        decoded = hf_tokenizer.decode(ids, skip_special_tokens=False)
        tried = [(t, 0) for t in (text, decoded) if t]
        bos = getattr(hf_tokenizer, "bos_token_id", None)
        if bos is not None and ids and ids[0] == bos:
            tried += [(t, 1) for t in (text, hf_tokenizer.decode(ids[1:], skip_special_tokens=False)) if t]
        for cand, num_bos in tried:
            if self.encode(cand, num_bos) == ids:
                return cand, num_bos
        text = decoded
        if not strict:
            return text, 0
        got = self.encode(text, 0)
        first = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
        raise LLMRunnerUnavailable(
            f"the C++ tokenizer ({self.tokenizer_path.name}) encodes the prompt differently from transformers "
            f"({len(got)} vs {len(ids)} tokens, first difference at token {first})"
        )

    def _piece_index(self) -> dict[str, list[int]]:
        if self._pieces is None:
            index: dict[str, list[int]] = {}
            for i in range(int(self._tok.vocab_size())):
                index.setdefault(self._tok.decode(i, i), []).append(i)
            # the runner streams an added special token (a chat model's <|im_end|>) as its literal text,
            # which the tokenizer's own decode does not give back: without these, the EOS that ends a
            # chat answer could not be told from other special tokens
            for text, i in _added_tokens(self.tokenizer_path).items():
                if i not in index.get(text, []):
                    index.setdefault(text, []).append(i)
            self._pieces = index
        return self._pieces

    def _candidates(self, piece: str, prev: int | None) -> list[int]:
        cands = self._piece_index().get(piece, [])
        if len(cands) > 1 and prev is not None:
            cands = [c for c in cands if self._tok.decode(prev, c) == piece] or cands
        return cands

    def _resolve_ids(self, pieces: list[str], ended_early: bool) -> list[int | None]:
        """Token ids for the pieces; where several ids give a piece, the EOS that ended generation
        (the runner stops on nothing else) or None."""
        ids: list[int | None] = []
        for k, piece in enumerate(pieces):
            cands = self._candidates(piece, ids[-1] if ids else None)
            if len(cands) > 1 and ended_early and k == len(pieces) - 1:
                cands = [c for c in cands if c in self.eos_ids] or cands
            ids.append(cands[0] if len(cands) == 1 else None)
        return ids

    # -- generation --------------------------------------------------------------------------

    def generate(
        self, text: str, max_new_tokens: int, *, num_bos: int = 0, on_id: Callable[[int | None], None] | None = None,
        temperature: float = 0.0,
    ) -> Generation:
        """Greedy (temperature 0) from a clean cache: ``max_new_tokens`` tokens, fewer if an EOS id
        comes first (the runner's own rule: the token from prefill is never EOS-checked). A
        ``temperature`` above 0 samples with the runner's own sampler (unseeded: it has no seed,
        top-k or top-p; ``export.decoding.sampling`` in the Python loop has them). ``on_id`` gets each token's
        id as the runner produces it (None where several ids give its piece: the returned ids resolve
        the EOS that ended generation)."""
        from executorch.extension.llm.runner import GenerationConfig

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        pieces: list[str] = []
        stats: list = []
        prev: list[int | None] = [None]

        def on_token(piece: str) -> None:
            pieces.append(piece)
            if on_id is not None:
                cands = self._candidates(piece, prev[0])
                prev[0] = cands[0] if len(cands) == 1 else None
                on_id(prev[0])

        cfg = GenerationConfig(echo=False, max_new_tokens=max_new_tokens, temperature=float(temperature), warming=True,
                               num_bos=num_bos)
        self._runner.reset()
        with captured_stderr() as log, serial_torch():
            try:
                self._runner.generate(text, cfg, on_token, stats.append)
            except Exception as exc:
                raise LLMRunnerUnavailable(f"TextLLMRunner.generate failed: {exc} ({_log_tail(log())})") from None
            finally:
                self._runner.reset()
                _flush_c_stdio()  # the runner printf()s a newline when it stops at EOS
        if not stats:
            raise LLMRunnerUnavailable("TextLLMRunner returned without stats")
        st = stats_dict(stats[0])
        cap = max_new_tokens
        if self.max_context_len is not None:  # the runner's own cap: prompt + new < max_context_len
            cap = min(cap, self.max_context_len - st["prompt_tokens"])
        ended_early = st["generated_tokens"] + 1 < cap
        ids = self._resolve_ids(pieces, ended_early)
        return Generation(ids=ids, pieces=pieces, stats=st, stopped_at_eos=ended_early,
                          prompt_ids=self.encode(text, num_bos), text=self.decode(ids))

    def timed(self, text: str, decode_tokens: int, *, num_bos: int = 0, runs: int = 3, warmup: int = 1) -> dict:
        """The runner's own Stats for prefill + ``decode_tokens`` steps: median of ``runs`` after ``warmup``."""
        done = [self.generate(text, decode_tokens + 1, num_bos=num_bos).stats
                for _ in range(warmup + runs)][warmup:]
        return {**median_stats(done), "runs": runs}


def _added_tokens(path: Path) -> dict[str, int]:
    """A ``tokenizer.json``'s added tokens, literal text -> id (none for a SentencePiece model)."""
    if path.suffix != ".json":
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {t["content"]: int(t["id"]) for t in data.get("added_tokens") or [] if "content" in t and "id" in t}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def _text_tokenizer(path: Path):
    """The tokenizer beside the program, to decode ids to text: ``tokenizers`` over a ``tokenizer.json``,
    else transformers over the folder."""
    if path.suffix == ".json":
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, local_files_only=True)


def _flush_c_stdio() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # pragma: no cover - no libc symbol table (not on Linux/macOS)
        pass


def _load_cpp_tokenizer(path: Path):
    """The same C++ tokenizer class TextLLMRunner's loader picks for this file."""
    from pytorch_tokenizers import CppHFTokenizer, CppSPTokenizer

    tok = CppHFTokenizer() if path.suffix == ".json" else CppSPTokenizer()
    with captured_stderr() as log:
        try:
            tok.load(str(path))
            error = None if tok.is_loaded() else "not loaded"
        except Exception as exc:  # e.g. "Unsupported Normalizer type: Lowercase"
            error = str(exc)
        if error:
            raise LLMRunnerUnavailable(f"the C++ tokenizer cannot load {path.name}: {error} ({_log_tail(log(), 1)})")
    return tok
