"""Reuse the baseline's accuracy across runs of the same model on the same text.

Every run measures the model as loaded before its first stage: its perplexity, and the
log-probabilities that every later row's top-1 agreement and KL are compared with. A re-run
(a resumed run, a recipe tried against another, the next example on the same checkpoint) would
measure the very same numbers again: about a minute for SmolLM2-135M on one CPU core, many for
a 1B model. With ``checks.baseline_cache`` the measurement is kept under the user cache
(``$OPTIMIZE_CACHE/baselines``), keyed by everything that determines it to the bit: the
model's class, config and every weight's bytes; the evaluation windows; where it runs (device
type, dtype, threads); the toolchain's versions and this package's evaluation code. Anything
else (a changed weight, other text, another torch) is a different key and measures again.

An entry holds what the run would have kept: the perplexity, the tokens scored, each window's
argmax ids and fp16 log-probabilities (``BaselineLogits``' own files, 400 MB for 4096 positions
of a 49152-token vocabulary). Entries are written whole or not at all (``atomic_dir``; two runs
filling one key keep the first), and only the :data:`KEEP` most recently used stay. A damaged
entry is ignored and measured again, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from optimize.checks.accuracy import BaselineLogits, logprobs_file
from optimize.export_cache import toolchain_versions
from targets.atomic import atomic_dir
from targets.user_cache import cache_root, keep_most_recent, link_or_copy, weights_digest

CACHE_VERSION = 1
#: entries kept (most recently used first); each is a few hundred MB for a small model
KEEP = 4
RESULT = "result.json"
TOP1 = "top1.pt"
#: the code whose change changes the numbers
_CODE = ("optimize/checks/accuracy.py", "export/decoding/runtime.py")


def cache_dir() -> Path:
    return cache_root() / "baselines"


def _code_digest() -> str:
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in _CODE:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]


def baseline_key(model: torch.nn.Module, windows: list[torch.Tensor], *, threads: int | None) -> str | None:
    """What determines the baseline's numbers, hashed; None where the model cannot be keyed."""
    weights = weights_digest(model)
    if weights is None:
        return None
    param = next(model.parameters(), None)
    text = hashlib.sha256()
    for w in windows:
        text.update(str(w.numel()).encode() + b"|")
        text.update(w.detach().cpu().to(torch.int64).numpy().tobytes())
    config = getattr(model, "config", None)
    key = {
        "version": CACHE_VERSION,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config.to_json_string(use_diff=False) if config is not None else None,
        "weights": weights,
        "windows": text.hexdigest(),
        "device": param.device.type if param is not None else "cpu",
        "dtype": str(param.dtype) if param is not None else None,
        "threads": threads,
        "toolchain": toolchain_versions(),
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass
class CachedBaseline:
    perplexity: float
    tokens: int
    path: Path


def load(key: str, into: BaselineLogits, root: Path | None = None) -> CachedBaseline | None:
    """Fill ``into`` (empty) from the entry for ``key``; None on a miss or a damaged entry
    (``into`` is then left empty). The log-probability files are linked (or copied) into
    ``into.directory``, so the run owns its copy and an eviction cannot pull them from under it."""
    entry = (root or cache_dir()) / key
    try:
        result = json.loads((entry / RESULT).read_text())
        top1 = torch.load(entry / TOP1, map_location="cpu", weights_only=True)
        n = int(result["windows"])
        if not isinstance(top1, list) or len(top1) != n or result.get("key") != key:
            return None
        files = [entry / logprobs_file(i) for i in range(n)]
        if not all(f.is_file() for f in files):
            return None
        if into.directory is None:
            into.logprobs = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
        else:
            into.directory.mkdir(parents=True, exist_ok=True)
            for i, f in enumerate(files):
                link_or_copy(f, into._file(i))
            into.spilled = n
        into.top1 = list(top1)
        os.utime(entry)  # most recently used
        return CachedBaseline(perplexity=float(result["perplexity"]), tokens=int(result["tokens"]), path=entry)
    except (OSError, ValueError, KeyError, RuntimeError, json.JSONDecodeError):
        into.top1, into.logprobs, into.spilled = [], [], 0
        return None


def store(key: str, baseline: BaselineLogits, perplexity: float, tokens: int, root: Path | None = None) -> Path:
    """Keep the run's baseline under ``key`` (first writer wins), then drop all but :data:`KEEP` entries."""
    root = root or cache_dir()
    entry = root / key
    if not (entry / RESULT).is_file():
        with atomic_dir(entry, keep_existing=True) as tmp:
            for i in range(len(baseline)):
                dst = tmp / logprobs_file(i)
                if baseline.directory is None:
                    torch.save(baseline.logprobs[i], dst)
                else:
                    link_or_copy(baseline._file(i), dst)
            torch.save(list(baseline.top1), tmp / TOP1)
            (tmp / RESULT).write_text(json.dumps({"key": key, "perplexity": perplexity, "tokens": tokens,
                                                  "windows": len(baseline)}) + "\n")
    keep_most_recent(root, KEEP)
    return entry
