"""The user cache (``$OPTIMIZE_CACHE``, else ``~/.cache/edge-optimize``): where GGUF files'
conversions live, and when they go.

A GGUF file is converted to a safetensors folder once (:func:`train.sources.convert_gguf`) and
reused while the file is unchanged. The baseline cache (``optimize.checks.baseline_cache``) keeps
its entries under the same root.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

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


def _conversion_source(entry: Path) -> str | None:
    """The GGUF path a conversion's ``source.json`` names; None where it has none readable."""
    try:
        origin = json.loads((entry / SOURCE_FILE).read_text())["gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return origin if isinstance(origin, str) else None
