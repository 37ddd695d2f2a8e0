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


__all__ = ["LogOutput", "console"]
