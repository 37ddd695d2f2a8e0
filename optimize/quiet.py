"""Keep a run off the process's stdout and stderr: everything goes to a log file instead.

``run_pipeline(..., progress=False)`` (the API's default) runs inside :class:`LogOutput`. Native
code (ExecuTorch's C++ runtime, cpuinfo, torchao's loaders) writes straight to file descriptors 1
and 2, so redirecting ``sys.stdout`` is not enough: the descriptors themselves are pointed at the
log (``os.dup2``) for the duration and restored afterwards, on any exit. On top of that
``sys.stdout`` / ``sys.stderr`` are replaced (a notebook's or pytest's streams are not fd-backed),
and logging handlers that hold the old streams (transformers' own handler, ``basicConfig``) are
pointed at the log too. C stdio buffers are flushed on both edges, so nothing written inside
surfaces later on the terminal.

:func:`console` is the stream that was stderr before the redirection: what a caller that wants
its own lines seen (the CLI's messages) writes to. File descriptors are process-wide: other threads
of the process write to the log too while a quiet run is in progress.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import TextIO

_CONSOLES: list[TextIO] = []


def console() -> TextIO:
    """The stderr of the caller: the stream before the innermost :class:`LogOutput`, else ``sys.stderr``."""
    return _CONSOLES[-1] if _CONSOLES else sys.stderr


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # no libc symbol (Windows): nothing buffered there we could reach anyway
        pass


def _flush(stream) -> None:
    try:
        stream.flush()
    except Exception:
        pass


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        lg for lg in list(logging.Logger.manager.loggerDict.values()) if isinstance(lg, logging.Logger)
    ]
    out = []
    for lg in loggers:
        for h in lg.handlers:
            if type(h) is logging.StreamHandler or (isinstance(h, logging.StreamHandler)
                                                    and not isinstance(h, logging.FileHandler)):
                out.append(h)
    return out


class LogOutput:
    """Context manager: fds 1 and 2, ``sys.stdout``/``sys.stderr`` and logging handlers on them all
    write to ``path`` (appended) until exit. :meth:`move_to` switches to another file, keeping
    what was written so far (the pipeline starts before it knows its run directory)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file: TextIO | None = None
        self._fds: dict[int, int] = {}
        self._streams: tuple | None = None
        self._handlers: list[tuple[logging.StreamHandler, object]] = []
        self._console: TextIO | None = None

    # ---- enter / exit

    def __enter__(self) -> "LogOutput":
        self._streams = (sys.stdout, sys.stderr)
        for s in self._streams:
            _flush(s)
        _flush_c_stdio()
        self._open(self.path)
        for fd in (1, 2):
            try:
                self._fds[fd] = os.dup(fd)
            except OSError:  # closed descriptor (a daemon): nothing to redirect or restore
                continue
        try:
            self._point_fds()
            old = set(map(id, (*self._streams, sys.__stdout__, sys.__stderr__)))
            for h in _stream_handlers():
                stream = getattr(h, "stream", None)
                if id(stream) in old:
                    try:
                        h.setStream(self.file)
                    except AttributeError:  # a handler that follows sys.stderr itself (logging.lastResort)
                        continue
                    self._handlers.append((h, stream))
            sys.stdout = sys.stderr = self.file
            _CONSOLES.append(self._console_stream())
        except BaseException:
            self._restore()
            raise
        return self

    def _console_stream(self) -> TextIO:
        """What was stderr: the old ``sys.stderr`` when it is not on fd 2 (pytest's capture, a
        notebook), else a stream on the saved copy of fd 2 (the old ``sys.stderr`` object still
        writes to fd 2, which now points at the log)."""
        old = self._streams[1]
        try:
            on_fd2 = old.fileno() == 2
        except (AttributeError, OSError, ValueError):
            on_fd2 = False
        if not on_fd2 or 2 not in self._fds:
            return old
        self._console = os.fdopen(os.dup(self._fds[2]), "w", buffering=1, encoding="utf-8", errors="replace")
        return self._console

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        if self.file is not None:
            _flush(self.file)
        _flush_c_stdio()
        for fd, saved in self._fds.items():
            try:
                os.dup2(saved, fd)
            finally:
                os.close(saved)
        self._fds.clear()
        for h, stream in self._handlers:
            try:
                h.setStream(stream)
            except Exception:
                pass
        self._handlers.clear()
        if self._streams is not None:
            sys.stdout, sys.stderr = self._streams
            if _CONSOLES and _CONSOLES[-1] in (self._streams[1], self._console):
                _CONSOLES.pop()
            self._streams = None
        if self._console is not None:
            _flush(self._console)
            self._console.close()
            self._console = None
        if self.file is not None:
            self.file.close()
            self.file = None

    # ---- the log file

    def _open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # append mode (O_APPEND): Python's writes and native writes to fds 1/2 interleave, never overwrite
        self.file = open(path, "a", buffering=1, encoding="utf-8", errors="replace")

    def _point_fds(self) -> None:
        for fd in self._fds:
            os.dup2(self.file.fileno(), fd)

    def move_to(self, path: str | Path) -> None:
        """Continue in ``path``; what the current file holds is copied to its start."""
        path = Path(path)
        if self.file is None or path.resolve() == self.path.resolve():
            return
        _flush(self.file)
        _flush_c_stdio()
        old_file, old_path = self.file, self.path
        self._open(path)
        self.path = path
        try:
            self.file.write(old_path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            pass
        self._point_fds()
        for h, _ in self._handlers:
            try:
                h.setStream(self.file)
            except AttributeError:
                pass
        if sys.stdout is old_file:
            sys.stdout = self.file
        if sys.stderr is old_file:
            sys.stderr = self.file
        old_file.close()
        old_path.unlink(missing_ok=True)

    def write(self, line: str) -> None:
        if self.file is not None:
            self.file.write(line if line.endswith("\n") else line + "\n")


# -- the CLI's own logging (optimize.cli): our records on stderr, known library noise dropped --


class DropNoise(logging.Filter):
    """Known-harmless third-party noise on CPU machines. Our own records always pass: a warning of
    ours may quote a library's "Failed to load ..." (the C++ tokenizer's refusal does)."""

    PATTERNS = ("Failed to load", "Enum subclass", "Detected no triton")
    OURS = ("optimize", "export", "train", "targets")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.partition(".")[0] in self.OURS:
            return True
        msg = record.getMessage()
        return not any(p in msg for p in self.PATTERNS)


def quiet_third_party() -> None:
    """Drop torchao's CUDA-extension load failures and triton notes, and pytree deprecations.
    Filters go on the root handlers: records propagated from child loggers skip logger filters."""
    warnings.filterwarnings("ignore", message=".*Enum subclass.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, DropNoise) for f in handler.filters):
            handler.addFilter(DropNoise())
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record, so ``main()`` called twice in one
    process (tests, notebooks) never writes to a stream an earlier caller closed."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_cli_logging(verbose: bool) -> None:
    """The CLI's log lines on stderr (INFO with ``-v``, else WARNING and above)."""
    root = logging.getLogger()
    if not any(isinstance(h, CurrentStderr) for h in root.handlers):
        handler = CurrentStderr()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


__all__ = ["CurrentStderr", "DropNoise", "LogOutput", "console", "quiet_third_party", "setup_cli_logging"]
