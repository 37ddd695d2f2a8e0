"""Real text, tokenized and split into disjoint evaluation, calibration and training spans.

The default corpus is ``pydoc_data.topics`` (the documentation shipped with every CPython),
so nothing downloads. The evaluation span is the corpus's first ``eval_tokens + 1`` tokens,
which is the reference measurement every peer figure in this project uses; calibration and
training text come strictly after it, so no figure is measured on text a stage has seen.
"""

from __future__ import annotations

from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Any

import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl")


class CorpusError(ValueError):
    """The corpus is missing, empty or too short for the requested spans."""


def load_text(corpus: str | Path = "pydoc") -> str:
    """``"pydoc"`` for CPython's bundled docs, or a text file, or a directory of text files."""
    if str(corpus) == "pydoc":
        from pydoc_data.topics import topics

        return "\n".join(topics.values())
    path = Path(corpus)
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise CorpusError(f"corpus directory {path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
        return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    raise CorpusError(f"corpus not found: {path} (use 'pydoc', a text file or a directory)")


def tokenize(text: str, tokenizer: Any) -> torch.Tensor:
    """All token ids of ``text`` as a 1-D LongTensor, without special tokens."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if not ids:
        raise CorpusError("the corpus tokenized to zero tokens")
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class Span:
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start


@dataclass
class CorpusSplits:
    """Token spans of one corpus. ``eval_ids`` has ``eval_tokens + 1`` ids (inputs + targets)."""

    eval_ids: torch.Tensor
    calib_ids: torch.Tensor
    train_ids: torch.Tensor
    spans: dict[str, Span]
    corpus: str
    total_tokens: int

    def describe(self) -> dict:
        return {
            "corpus": self.corpus,
            "total_tokens": self.total_tokens,
            **{name: asdict(span) | {"tokens": span.tokens} for name, span in self.spans.items()},
        }


def split_corpus(
    ids: torch.Tensor,
    *,
    eval_tokens: int,
    calib_tokens: int,
    corpus: str = "pydoc",
    min_train_tokens: int = 0,
) -> CorpusSplits:
    """Evaluation first (the reference span), then calibration, then the rest for training."""
    n = int(ids.numel())
    eval_span = Span(0, eval_tokens + 1)
    calib_span = Span(eval_span.stop, eval_span.stop + calib_tokens)
    train_span = Span(calib_span.stop, n)
    need = calib_span.stop + min_train_tokens
    if n < need:
        raise CorpusError(
            f"corpus {corpus!r} has {n} tokens; evaluation ({eval_tokens + 1}) + calibration ({calib_tokens})"
            f" + training ({min_train_tokens}) need {need}. Lower data.eval_tokens / data.calibration_tokens"
            " or give a larger corpus."
        )
    return CorpusSplits(
        eval_ids=ids[eval_span.start : eval_span.stop],
        calib_ids=ids[calib_span.start : calib_span.stop],
        train_ids=ids[train_span.start : train_span.stop],
        spans={"eval": eval_span, "calibration": calib_span, "train": train_span},
        corpus=corpus,
        total_tokens=n,
    )


def split_data(data: Any, tokenizer: Any, *, calib_tokens: int | None = None) -> CorpusSplits:
    """A pipeline ``data`` block's corpus, tokenized and split (``corpus``, ``eval_tokens``,
    ``calibration_tokens``; ``calib_tokens`` overrides the latter): what the pipeline, ``optimize
    sensitivity`` and ``optimize fit`` all measure on."""
    ids = tokenize(load_text(data.corpus), tokenizer)
    calib = data.calibration_tokens if calib_tokens is None else calib_tokens
    return split_corpus(ids, eval_tokens=data.eval_tokens, calib_tokens=calib, corpus=data.corpus)

def windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> list[torch.Tensor]:
    """Cut ids into non-overlapping windows of ``seq_len`` (the last may be shorter, never < 2)."""
    out = []
    for start in range(0, int(ids.numel()), seq_len):
        chunk = ids[start : start + seq_len]
        if chunk.numel() >= 2:
            out.append(chunk)
        if max_windows is not None and len(out) >= max_windows:
            break
    return out
