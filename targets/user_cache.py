"""The user cache (``$OPTIMIZE_CACHE``, else ``~/.cache/edge-optimize``): where GGUF files'
conversions live, and when they go.

A GGUF file is converted to a safetensors folder once (:func:`targets.sources.convert_gguf`) and
reused while the file is unchanged. The baseline cache (``optimize.checks.baseline_cache``) keeps
its entries under the same root.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("optimize")


#: in each conversion: the GGUF file it was made from
SOURCE_FILE = "source.json"


def cache_root(explicit: Path | None = None) -> Path:
    """``explicit`` (a source's ``cache_dir``), else ``$OPTIMIZE_CACHE``, else the XDG user cache."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("OPTIMIZE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-optimize"


def conversion_dir(gguf: Path, cache_dir: Path | None) -> Path:
    """Where ``gguf`` is converted to: keyed by its resolved path, size and mtime, so an edited or
    reinstalled file converts again (and :func:`drop_stale_conversions` removes the old one)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "gguf" / f"{gguf.stem}-{key}"


def record_source(folder: Path, gguf: Path) -> None:
    """Name the GGUF file a conversion (still in its temporary ``folder``) was made from."""
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve())}))


def drop_stale_conversions(fresh: Path, gguf: Path) -> None:
    """Remove the conversions that no load can hit again: those of a GGUF file that is gone,
    and older ones of ``gguf``, the file ``fresh`` was converted from (its key holds the file's
    size and mtime, so a reinstall or an edit makes a new entry). Without this every reinstall of
    a bundled model left another full-precision copy behind (500 MB each for SmolLM2-135M).
    Conversions of other GGUF files that still exist are kept; a directory without a readable
    ``source.json`` is not ours to judge and stays."""
    source = str(gguf.resolve())
    for entry in fresh.parent.iterdir():
        if entry == fresh or entry.name.startswith(".") or not entry.is_dir():
            continue  # a conversion in progress is a dot-prefixed temporary sibling
        origin = _conversion_source(entry)
        if origin is not None and (origin == source or not Path(origin).is_file()):
            log.info("removing stale GGUF conversion %s (source %s)", entry, origin)
            shutil.rmtree(entry, ignore_errors=True)
            # its lock file too (targets.sources.convert_gguf): no load converts that key again
            entry.with_name(f".{entry.name}.lock").unlink(missing_ok=True)


def _conversion_source(entry: Path) -> str | None:
    """The GGUF path a conversion's ``source.json`` names; None where it has none readable."""
    try:
        origin = json.loads((entry / SOURCE_FILE).read_text())["gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return origin if isinstance(origin, str) else None


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link of ``src`` at ``dst`` (no second copy of a model's bytes), or a copy across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


#: a lock file with no entry beside it is removed once it is this old (its writer is long gone)
ORPHAN_LOCK_S = 3600


def keep_most_recent(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used entries (directories) of a cache under ``root``,
    with their lock files (``.<entry>.lock``, :func:`targets.atomic.exclusive`), and lock files that
    lost their entry an hour ago or more (a stage too short to keep still took its key's lock).
    Entries being written (dot-prefixed temporaries) are never touched."""
    import time

    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)
        old.with_name(f".{old.name}.lock").unlink(missing_ok=True)
    now = time.time()
    for lock in root.glob(".*.lock"):
        entry = lock.with_name(lock.name[1:-len(".lock")])
        try:
            if not entry.exists() and now - lock.stat().st_mtime > ORPHAN_LOCK_S:
                lock.unlink()
        except OSError:
            pass


def weights_digest(model: torch.nn.Module) -> str | None:
    """sha256 over every parameter's and buffer's name, dtype, shape and bytes; None where a
    tensor has no plain bytes to hash (a quantized tensor subclass)."""
    h = hashlib.sha256()
    for name, t in model.state_dict(keep_vars=False).items():
        if type(t) is not torch.Tensor or t.is_quantized or t.layout != torch.strided:
            return None
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def ids_digest(tensors) -> str:
    """sha256 of token-id tensors (their shapes and values): the text a cached result was computed on."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode() + b"|")
        h.update(t.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of this project's own Python source (``optimize``, ``train``, ``targets``, ``export``):
    a cached stage's result follows its code, so an edited stage must not reuse it."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for package in ("optimize", "train", "targets", "export"):
        for f in sorted((root / package).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]

