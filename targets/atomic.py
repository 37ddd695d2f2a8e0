"""Atomic file and directory writes: a crash never leaves a half-written artifact behind.

Everything we ship (models, reports, manifests, checkpoints) goes through these helpers:
write to a temporary sibling, flush and fsync, then ``os.replace`` onto the final name.
It lives in ``targets`` (the leaf package) so that ``export``, ``train`` and ``optimize``
all use the same few functions.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's data to disk (a rename is durable only after its content is)."""
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def fsync_tree(root: Path) -> None:
    """fsync every file below ``root``, then every directory, deepest first."""
    dirs = []
    for dirpath, _, filenames in os.walk(root):
        dirs.append(Path(dirpath))
        for name in filenames:
            fsync_file(Path(dirpath) / name)
    for d in reversed(dirs):
        fsync_dir(d)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def recover_leftovers(final: str | os.PathLike) -> None:
    """Undo what a writer killed mid-write left beside ``final``.

    Temporary siblings (``.<name>.<pid>.*.tmp``) of dead processes are deleted. A directory
    moved aside (``.<name>.old-<pid>``) by a writer that died before its new copy was renamed
    into place is the last complete version: it is put back when ``final`` is missing, and
    deleted otherwise. Writers call this before they start, so a re-run heals the directory.
    """
    final = Path(final)
    parent = final.parent
    if not parent.is_dir():
        return
    prefix = f".{final.name}."
    for sib in parent.iterdir():
        name = sib.name
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest.startswith("old-") and rest[4:].isdigit():
            if _pid_alive(int(rest[4:])):
                continue
            if not final.exists():
                os.replace(sib, final)
                fsync_dir(parent)
            else:
                shutil.rmtree(sib, ignore_errors=True)
        elif rest.endswith(".tmp") and rest.split(".", 1)[0].isdigit():
            if _pid_alive(int(rest.split(".", 1)[0])):
                continue
            if sib.is_dir():
                shutil.rmtree(sib, ignore_errors=True)
            else:
                sib.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success it is renamed onto ``final``.

    Use it for writers that insist on taking a path (``torch.save``, ``write_to_file``,
    ``onnx.save``). On an exception the temporary file is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_leftovers(final)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        fsync_file(tmp_path)
        os.replace(tmp_path, final)
        fsync_dir(final.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)
    return Path(final)


def atomic_write_text(final: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(final, text.encode("utf-8"))


def atomic_write_json(final: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(final, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``final``; on success it replaces ``final`` whole.

    Every file inside is fsynced before the rename, so after a power cut the directory is
    either absent, the old one, or complete. An existing ``final`` is moved aside first and
    deleted only after the new one is in place, so at every instant either the old or the new
    complete directory exists.

    ``keep_existing`` is for caches that several processes may fill at once (two pipelines, or
    test workers converting the same GGUF): the first complete directory wins and later ones
    are discarded, so a process reading the winner never sees it replaced under it. The rename
    onto an existing non-empty directory fails atomically, so there is no window between check
    and rename.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_leftovers(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        if keep_existing:
            try:
                os.rename(tmp, final)  # fails (EEXIST/ENOTEMPTY) if another writer got there first
            except OSError:
                if not final.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                fsync_dir(final.parent)
            return
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive(lock_file: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if missing) for the block.

    For caches that several processes fill: the one that takes the lock computes the entry,
    the others wait here, then find it written and reuse it instead of computing it again (two
    test workers converting the same GGUF, two pipelines running the same stage). ``flock``
    locks go with their process, so one that dies mid-way never leaves the others waiting.
    The lock file stays (deleting it would race with a waiter that has it open)."""
    import fcntl

    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()
