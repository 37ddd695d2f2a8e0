"""Which exceptions are the user's bad input (one line, exit 2) and which are bugs (traceback, exit 1).

Why a module of its own: ``python -m train`` and every ``optimize`` verb must answer the same
way, and an internal failure reported as "your input is wrong" (one line, no traceback, exit 2)
hides the bug from whoever has to fix it. It happened: a tensor-unpacking ``ValueError`` raised
inside torchao under FSDP2 was printed as one line with exit 2.

A refusal is, and only is:

- an exception whose class (or a base class) is a public class of this project, such as
  ``RecipeError``, ``ConfigError``, ``ModelSourceError`` or ``ExportError``: these are raised on
  purpose and their messages are written for the user;
- a ``FileNotFoundError`` (a path the user gave does not exist);
- a plain ``ValueError``/``TypeError`` raised *by an explicit* ``raise`` *statement* in this
  project's own code (the innermost frame is ours and its line is the ``raise``): a refusal
  worded by us. The same exception types raised implicitly in our code (a failed tuple unpack,
  ``int("x")``) or anywhere in a library are bugs, and keep their traceback.
"""

from __future__ import annotations

import linecache

#: top-level packages of this project
PROJECT_PACKAGES = ("optimize", "train", "export", "targets")


def _ours(module: str) -> bool:
    return module.split(".")[0] in PROJECT_PACKAGES


class TrainInputError(ValueError):
    """A training request this machine or launch cannot honour (e.g. ``device: cuda`` without CUDA,
    ``distributed.fsdp`` without torchrun, a checkpoint written by another optimizer kind)."""


def is_refusal(exc: BaseException) -> bool:
    """True when ``exc`` refuses bad input (print one line, exit 2); False for a bug (traceback, exit 1)."""
    if isinstance(exc, FileNotFoundError):
        return True
    if any(_ours(c.__module__) and not c.__name__.startswith("_") for c in type(exc).__mro__):
        return True
    if isinstance(exc, (ValueError, TypeError)) and exc.__traceback__ is not None:
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        frame = tb.tb_frame
        if not _ours(frame.f_globals.get("__name__", "")):
            return False
        line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno, frame.f_globals).strip()
        return line.startswith("raise ")
    return False
