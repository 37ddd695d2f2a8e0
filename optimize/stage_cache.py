"""Reuse a finished stage across runs: the same stages on the same weights, data and code.

A run resumes from its own checkpoints (:mod:`optimize.checkpoints`); that helps a re-run of
the same output directory. A recipe sweep, a second example that starts with the same AWQ, or
another target for the same quantized model runs in another directory and computed every stage
again (AWQ + GPTQ on SmolLM2-135M: minutes on a 2-core CPU; on a 1B model, an hour). With
``stage_cache: true`` a finished stage's checkpoint is also kept under the user cache
(``$OPTIMIZE_CACHE/stages``, linked, not copied, from the run's own checkpoint), keyed by
everything that determines the model after it:

- the config up to that stage (:func:`optimize.checkpoints.prefix_hash`: model source, data,
  seed, every stage's options; names and gates left out, since they change no weight);
- every byte of the model as loaded (so a re-converted or edited checkpoint is another key);
- the calibration and training token ids the stages read, and the target profile (stages take
  their scheme from it);
- the device type and dtype the stages ran in, the toolchain's versions and this project's own
  source code (an edited stage must not reuse what the old code computed).

A run with the option on takes the longest prefix of its stages found in the cache, then
computes the rest. The report row of a reused stage is re-gated against this run's gates; where
the run's checks differ from those the row was measured with (other evaluation text, threads,
latency settings), the reused model is measured again instead of recomputed. While one process
computes a stage, another run that needs the same one waits for it and then reuses it
(:func:`targets.atomic.exclusive`), so two pipelines started together compute it once.

Bounded: only stages that took at least :data:`MIN_STAGE_S` are kept (a seconds-long fold is not
worth a model's bytes on disk), and only the :data:`KEEP` most recently used entries stay.
Entries are written whole or not at all and a damaged one is a miss, never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from optimize import checkpoints as ckpt
from optimize.export_cache import toolchain_versions
from targets.atomic import atomic_dir, atomic_write_json, exclusive
from targets.user_cache import cache_root, ids_digest, keep_most_recent, link_or_copy, source_digest, weights_digest

CACHE_VERSION = 1
#: entries kept, most recently used first (a stage checkpoint is the model's size: 250-550 MB for SmolLM2-135M)
KEEP = 4
#: a stage is kept only when computing it (and measuring its row) took at least this long
MIN_STAGE_S = 10.0
#: in an entry (and beside a checkpoint it was linked into): what the row was measured with
CHECKS_FILE = "checks.json"


def cache_dir() -> Path:
    return cache_root() / "stages"


class StageCache:
    """The keys of one run's stages, and the cache operations the pipeline runner calls."""

    def __init__(self, keys: list[str], checks_key: str, root: Path | None = None):
        self.keys, self.checks_key = keys, checks_key
        self.root = Path(root) if root is not None else cache_dir()

    @classmethod
    def for_run(cls, config_dump: dict, n_stages: int, model: torch.nn.Module, *, calibration, train_ids,
                profile: Any, device: torch.device, dtype: torch.dtype, checks_key: str,
                root: Path | None = None) -> StageCache | None:
        """The run's keys, or None where the loaded model cannot be keyed by its bytes."""
        weights = weights_digest(model)
        if weights is None:
            return None
        common = {
            "version": CACHE_VERSION,
            "weights": weights,
            "calibration": ids_digest(calibration),
            "train_ids": ids_digest([train_ids]) if train_ids is not None else None,
            "target": profile.model_dump(mode="json") if profile is not None else None,
            "device": torch.device(device).type,
            "dtype": str(dtype),
            "toolchain": toolchain_versions(),
            "code": source_digest(),
        }
        keys = []
        for i in range(n_stages):
            key = dict(common, prefix=ckpt.prefix_hash(config_dump, i))
            keys.append(hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24])
        return cls(keys, checks_key, root)

    def entry(self, i: int) -> Path:
        return self.root / self.keys[i]

    @contextlib.contextmanager
    def claim(self, i: int) -> Iterator[None]:
        """Hold stage ``i``'s key while this process computes it; another process waits here."""
        with exclusive(self.root / f".{self.keys[i]}.lock"):
            yield

    def fetch(self, i: int, stage_dir: Path) -> bool:
        """Link the cached checkpoint of stage ``i`` into ``stage_dir`` (replacing what is there);
        False on a miss or a damaged entry."""
        entry = self.entry(i)
        files = sorted(f for f in entry.glob("*") if f.is_file()) if entry.is_dir() else []
        names = {f.name for f in files}
        if not {ckpt.COMPLETE, "model.pt", "config.json", "row.json", CHECKS_FILE} <= names:
            return False
        try:
            json.loads((entry / "row.json").read_text())
            json.loads((entry / CHECKS_FILE).read_text())
            with atomic_dir(stage_dir) as tmp:
                for f in files:
                    link_or_copy(f, tmp / f.name)
        except (OSError, ValueError):
            return False
        os.utime(entry)  # most recently used
        return True

    def discard(self, i: int) -> None:
        """Drop stage ``i``'s entry (it did not load)."""
        shutil.rmtree(self.entry(i), ignore_errors=True)

    def store(self, i: int, stage_dir: Path, wall_s: float) -> Path | None:
        """Keep stage ``i``'s finished checkpoint (linked) when it was worth keeping; first writer wins."""
        atomic_write_json(stage_dir / CHECKS_FILE, {"checks_key": self.checks_key})
        if wall_s < MIN_STAGE_S:
            return None
        entry = self.entry(i)
        if not (entry / ckpt.COMPLETE).is_file():
            with atomic_dir(entry, keep_existing=True) as tmp:
                for f in sorted(stage_dir.iterdir()):
                    if f.is_file():
                        link_or_copy(f, tmp / f.name)
        keep_most_recent(self.root, KEEP)
        return entry


def measured_with(stage_dir: Path) -> str | None:
    """The checks key a checkpoint's row was measured with (None where it was not recorded)."""
    try:
        return json.loads((Path(stage_dir) / CHECKS_FILE).read_text()).get("checks_key")
    except (OSError, ValueError, AttributeError):
        return None
