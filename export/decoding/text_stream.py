"""Generated token ids as text streamed in whole characters, ending in exactly ``tokenizer.decode``.

Why: byte-level tokenizers (GPT-2, Llama 3, Qwen, SmolLM2) split a character that is not ASCII
across tokens: SmolLM2 writes "わ" as ids 10391 and 233, the first two and the last of its three
UTF-8 bytes. Decoding each token alone prints a replacement character (U+FFFD) for each half, so a
Japanese answer came out as a row of "�". SentencePiece models with byte fallback (Llama 2, Gemma)
do the same with their ``<0xE3>`` tokens. A stream must hold such bytes back until the character is
complete.

How: :class:`TextStream` decodes a short window of ids, from the token where the text shown so far
last ended on a whole character, and shows what the newest ids add to it, unless the window's text
ends in U+FFFD (a character still incomplete): then it waits for the next id. The window keeps the
text independent of where it starts (a SentencePiece decoder drops the space of a sequence's first
token; both the window and its shown part start on the same token, so the difference is right), and
the cost per token constant. Where the tokenizer cleans up spaces before punctuation
(``clean_up_tokenization_spaces``), trailing whitespace is also held, as the next token may remove
it. :meth:`TextStream.finish` shows the rest, and the whole text is ``tokenizer.decode(ids)``.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

#: what a decoder gives for bytes that do not (yet) form a character
REPLACEMENT = "\ufffd"
#: a SentencePiece byte-fallback token's spelling
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
#: the text from its last whitespace on
_LAST_WORD = re.compile(r"\s+\S*\Z")


class TextStream:
    """Push generated ids as they come; ``write`` gets each new whole-character piece.

    ``tokenizer`` is a transformers tokenizer (anything with ``decode(ids, skip_special_tokens=)``).
    ``shown`` is what was written so far; :meth:`finish` writes the rest and returns the text, equal
    to ``tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)``."""

    def __init__(self, tokenizer: Any, write: Callable[[str], None] | None = None, *,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._write = write
        self._hold_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._byte_tokens = _has_byte_tokens(tokenizer)
        self._skipped = set(getattr(tokenizer, "all_special_ids", ()) or ()) if skip_special_tokens else set()
        self.ids: list[int] = []
        self.shown = ""
        # the window: ids[_start:] is decoded each time; ids[_start:_read] gave _window_shown, all shown
        self._start = 0
        self._read = 0
        self._window_shown = ""
        self._finished: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, piece: str) -> str:
        if piece:
            self.shown += piece
            if self._write is not None:
                self._write(piece)
        return piece

    def _in_byte_run(self) -> bool:
        """Whether the last id that decodes to something is a byte token (skipped special tokens do not end a
        run: the decoder sees the bytes on both sides of one as one run)."""
        last = next((i for i in reversed(self.ids) if i not in self._skipped), None)
        return last is not None and bool(_BYTE_TOKEN.fullmatch(str(self._tokenizer.convert_ids_to_tokens(last))))

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; writes and returns the text they complete ('' while a character or a
        space the tokenizer may clean up is held)."""
        if self._finished is not None:
            raise RuntimeError("push after finish")
        self.ids.extend([int(ids)] if isinstance(ids, int) else (int(i) for i in ids))
        if self._byte_tokens and self._in_byte_run():
            return ""  # the run of byte tokens decodes as one group: wait for its end
        if self._hold_spaces:
            return self._push_cleaned()
        text = self._decode(self.ids[self._start:])
        if text.endswith(REPLACEMENT) or not text.startswith(self._window_shown):
            return ""
        new = text[len(self._window_shown):]
        if not new:  # the window must keep a token that shows, or a decoder that joins words with spaces
            return ""  # would lose the one before the next
        # the text now ends on a whole character: the next window starts where this one read to
        self._start, self._read = self._read, len(self.ids)
        self._window_shown = self._decode(self.ids[self._start:self._read])
        return self._emit(new)

    def _push_cleaned(self) -> str:
        """For a tokenizer that cleans up spaces (" ." to ".", " ' " to "'"): the whole text decoded, shown up to
        its last space, which a later token may still remove with what follows it. Such tokenizers are
        WordPiece's (transformers 5 refuses the cleanup for BPE), so no LLM's answer pays this quadratic decode."""
        text = _LAST_WORD.sub("", self._decode(self.ids)).rstrip(REPLACEMENT)
        if len(text) > len(self.shown) and text.startswith(self.shown):
            return self._emit(text[len(self.shown):])
        return ""

    def finish(self) -> str:
        """Write what is still held and return the whole text (``tokenizer.decode`` of every id)."""
        if self._finished is not None:
            return self._finished
        text = self._decode(self.ids)
        if text.startswith(self.shown):
            self._emit(text[len(self.shown):])
        else:  # a decoder that rewrote text already shown: it cannot be unwritten; the result is still exact
            log.warning("the streamed text differs from the decoded answer after %d characters; the returned "
                        "text is the decoded one", next((i for i, (a, b) in enumerate(zip(text, self.shown))
                                                         if a != b), min(len(text), len(self.shown))))
        self._finished = text
        return text


def _has_byte_tokens(tokenizer: Any) -> bool:
    """Whether the vocabulary has SentencePiece byte-fallback tokens (``<0x41>`` is one)."""
    try:
        i = tokenizer.convert_tokens_to_ids("<0x41>")
    except Exception:  # not a transformers tokenizer
        return False
    return isinstance(i, int) and i != getattr(tokenizer, "unk_token_id", None)


def stream_ids(tokenizer: Any, ids: Iterable[int], write: Callable[[str], None] | None = None, *,
               skip_special_tokens: bool = True) -> list[str]:
    """The pieces a :class:`TextStream` writes for ``ids`` pushed one at a time, the last from ``finish``
    (empty pieces left out): what a user sees, for tests and for callers that have the ids already."""
    pieces: list[str] = []

    def keep(piece: str) -> None:
        pieces.append(piece)
        if write is not None:
            write(piece)

    stream = TextStream(tokenizer, keep, skip_special_tokens=skip_special_tokens)
    for i in ids:
        stream.push(i)
    stream.finish()
    return pieces
