"""Reuse an export across re-runs, as finished stages are reused.

An export is keyed by what determines its bytes: the model (the hash of the config up to the
last stage, which is how stage checkpoints are keyed), the target profile, the exporter's
validated options, the toolchain versions and the exporter's own source code. After an
export has been written and verified, :func:`save` records the key, every file's sha256 and
the report rows in ``export/<target>.cache.json``. A re-run with the same key whose files all
still hash the same reuses them (:func:`load`); a re-run whose checks changed re-measures the
cached artifacts instead of exporting again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
from pathlib import Path
from typing import Any

import export
from targets.atomic import atomic_write_json, sha256_file

CACHE_VERSION = 1
TOOLCHAIN = ("torch", "transformers", "torchao", "executorch", "onnx", "onnxruntime", "onnxscript",
             "onnxruntime-genai", "onnx-ir", "edge-optimize")


def toolchain_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in TOOLCHAIN:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _exporter_source_digest() -> str:
    """Hash of the ``export`` package's code: an edited exporter must not reuse old artifacts."""
    h = hashlib.sha256()
    root = Path(export.__file__).parent
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def export_key(model_digest: str, profile: Any, options: Any) -> str:
    key = {
        "version": CACHE_VERSION,
        "model": model_digest,
        "profile": profile.model_dump(mode="json"),
        "options": options.model_dump(mode="json"),
        "toolchain": toolchain_versions(),
        "exporter_code": _exporter_source_digest(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(run_dir: Path, target: str) -> Path:
    return Path(run_dir) / "export" / f"{target}.cache.json"


def save(path: Path, key: str, checks_key: str, files: list[Path], result: dict, rows: list[dict]) -> None:
    entry = {
        "version": CACHE_VERSION,
        "key": key,
        "checks_key": checks_key,
        "files": {str(f): {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files if Path(f).is_file()},
        "result": result,
        "rows": rows,
    }
    atomic_write_json(path, entry)


def load(path: Path, key: str) -> dict | None:
    """The cache entry if it was written for ``key`` and every file it lists is unchanged."""
    try:
        entry = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("version") != CACHE_VERSION or entry.get("key") != key:
        return None
    for name, meta in (entry.get("files") or {}).items():
        f = Path(name)
        if not f.is_file() or f.stat().st_size != meta.get("bytes") or sha256_file(f) != meta.get("sha256"):
            return None
    return entry


def invalidate(path: Path) -> None:
    Path(path).unlink(missing_ok=True)
