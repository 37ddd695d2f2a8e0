"""The decoder blocks' GPTQ results, kept for another run that quantizes the same blocks.

Sequential GPTQ is most of a 4-bit recipe's time (SmolLM2-135M, 32 calibration windows: the
float64 calibration forwards through 30 blocks), and the blocks' result depends only on the model
as it enters GPTQ, the calibration windows, the options and each block Linear's scheme. The
output head comes last and reads what the quantized blocks output, so two recipes that differ only
in the head (the demo's int8 ``lm_head`` against an all-4-bit recipe's tied int4 head, a sweep
over the head's precision) compute the very same blocks. With ``stage_cache: true`` the pipeline
gives GPTQ a cache directory: after the last block, every block Linear's integers and scales and
the calibration windows' hidden states after the last block are kept under a key of all the above
(plus the device type, toolchain and this project's source); a later run with the same key
installs them and goes straight to the head, which then calibrates on exactly the states it would
have computed.

Entries are written whole or not at all, read with ``weights_only=True``, checked against their
key, and only the :data:`KEEP` most recently used stay (about 200 MB each for SmolLM2-135M).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from optimize.export_cache import toolchain_versions
from optimize.quant.fakequant import WeightScheme
from optimize.quant.gptq import GptqLayerResult
from targets.atomic import atomic_dir, exclusive
from targets.user_cache import ids_digest, keep_most_recent, source_digest, weights_digest

CACHE_VERSION = 1
#: entries kept, most recently used first
KEEP = 4
ENTRY = "blocks.pt"


@dataclass
class CachedBlocks:
    """What the blocks' GPTQ left: each block Linear's result and every window's hidden states after the last block."""

    layers: dict[str, GptqLayerResult]
    hidden: list[torch.Tensor]
    tokens: int
    steps: list[str]


#: config fields that say where a model was loaded from or written by, not what it computes
_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path")


def _architecture(model: nn.Module) -> dict | None:
    """The model's config without where it came from: a model reloaded from another run's
    checkpoint (another path) computes what the original did."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    return {k: v for k, v in config.to_dict().items() if k not in _PROVENANCE}


class GptqBlockCache:
    """The blocks' results for one key under ``root``; ``key`` is None where the model cannot be keyed."""

    def __init__(self, root: Path, key: str | None):
        self.root, self.key = Path(root), key

    @classmethod
    def for_run(cls, root: Path, model: nn.Module, windows: list[torch.Tensor], targets: dict[str, WeightScheme],
                options: dict, device: torch.device | None) -> GptqBlockCache:
        """Key the blocks' GPTQ by the model as it enters (every weight's bytes), the windows, the
        options and the schemes of the block Linears (``targets`` without the head)."""
        weights = weights_digest(model)
        if weights is None:
            return cls(root, None)
        param = next(model.parameters(), None)
        key = {
            "version": CACHE_VERSION,
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config": _architecture(model),
            "weights": weights,
            "windows": ids_digest(windows),
            "targets": {n: [s.bits, s.group_size, s.act_int8, s.algorithm, s.act_per_tensor]
                        for n, s in sorted(targets.items())},
            "options": options,
            "dtype": str(param.dtype) if param is not None else None,
            "device": torch.device(device).type if device is not None else (param.device.type if param is not None
                                                                            else "cpu"),
            "toolchain": toolchain_versions(),
            "code": source_digest(),
        }
        return cls(root, hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24])

    @property
    def entry(self) -> Path:
        return self.root / f"gptq-blocks-{self.key}"

    def lock(self):
        """Held while this process computes the blocks: another run with the same key waits, then loads."""
        return exclusive(self.root / f".gptq-blocks-{self.key}.lock")

    def load(self) -> CachedBlocks | None:
        """The entry, or None on a miss or a damaged entry (never trusted)."""
        if self.key is None:
            return None
        try:
            data = torch.load(self.entry / ENTRY, map_location="cpu", weights_only=True)
            if data.get("key") != self.key:
                return None
            layers = {name: GptqLayerResult(q=d["q"], scale=d["scale"], rel_error_rtn=float(d["rtn"]),
                                            rel_error_gptq=float(d["gptq"]), damp=float(d["damp"]))
                      for name, d in data["layers"].items()}
            hidden = list(data["hidden"])
            result = CachedBlocks(layers=layers, hidden=hidden, tokens=int(data["tokens"]), steps=list(data["steps"]))
        except Exception:  # noqa: BLE001 - any damage (truncated zip, garbage, a foreign pickle) is a miss
            return None
        os.utime(self.entry)  # most recently used
        return result

    def store(self, layers: dict[str, GptqLayerResult], hidden: list[torch.Tensor], tokens: int,
              steps: list[str]) -> None:
        if self.key is None:
            return
        if not (self.entry / ENTRY).is_file():
            data = {"key": self.key, "tokens": tokens, "steps": steps,
                    "hidden": [h.detach().cpu() for h in hidden],
                    "layers": {name: {"q": r.q.cpu(), "scale": r.scale.cpu(), "rtn": r.rel_error_rtn,
                                      "gptq": r.rel_error_gptq, "damp": r.damp} for name, r in layers.items()}}
            with atomic_dir(self.entry, keep_existing=True) as tmp:
                torch.save(data, tmp / ENTRY)
        keep_most_recent(self.root, KEEP)
