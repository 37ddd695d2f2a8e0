"""The exporter contract: every target runtime implements one :class:`Exporter`.

An exporter turns an eager HF causal LM into a shipped artifact in an output directory and
can load that artifact back as a :class:`~export.decoding.runtime.Runner`, so the pipeline verifies
what it ships in the runtime that will run it. Exporters never import ``optimize``.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
from targets.config_base import Strict

from export.decoding.runtime import Runner


class ExportError(RuntimeError):
    """Export failed or produced an artifact that does not verify; the message says which."""


class ExportOptions(Strict):
    """Base for each exporter's typed options (a block in the pipeline YAML)."""


@dataclass
class ExportResult:
    """What an export wrote. ``artifact`` is the file a runner loads; ``files`` lists every
    file written (tokenizer, manifest, external data...); ``details`` is JSON-serializable
    information for the report (delegation stats, quantization mix, toolchain versions...)."""

    artifact: Path
    files: list[Path] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    #: further artifacts of the same export that are verified and reported on their own
    #: (e.g. TorchChat's .pth, .pte and .pt2): label -> path that :meth:`Exporter.load` loads.
    #: The pipeline gives each a report row named ``export:<target>:<label>``.
    extra_artifacts: dict[str, Path] = field(default_factory=dict)
    #: details for each extra artifact's row, by label
    extra_details: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class DraftSpec:
    """A draft model for speculative decoding, exported beside the target by exporters that can
    (``supports_draft``): the model (sharing the target's tokenizer) and, for a draft head over part of
    the vocabulary, how often each token id occurs in the run's text (``token_counts[id]``)."""

    model: torch.nn.Module
    token_counts: torch.Tensor | None = None


class Exporter(abc.ABC):
    name: ClassVar[str]
    #: the pydantic model validating this exporter's options block
    options_model: ClassVar[type[ExportOptions]]
    #: artifact file suffixes this exporter's runner can load (for ``optimize run``)
    suffixes: ClassVar[tuple[str, ...]] = ()
    #: whether :meth:`export` takes a ``draft`` (a speculative-decoding draft model written beside the target)
    supports_draft: ClassVar[bool] = False

    @abc.abstractmethod
    def export(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        out_dir: Path,
        options: ExportOptions,
        *,
        calibration: Sequence[torch.Tensor] = (),
        log=print,
    ) -> ExportResult:
        """Write the artifact and its companions into ``out_dir`` atomically. Exporters that
        ``supports_draft`` also take ``draft=DraftSpec(...)``."""

    @abc.abstractmethod
    def load(self, artifact: Path, **kwargs) -> Runner:
        """Load an artifact written by :meth:`export` as a runner."""

    def check_model(self, config: Any, options: ExportOptions) -> list[str]:
        """Problems that the model's transformers ``config`` alone shows (architecture, shapes,
        attention kind against what this exporter supports), as the pipeline's stages will leave
        it. Run by ``optimize validate`` and before the first stage, so an export that cannot
        work is refused before minutes of stages. Each problem is one sentence; [] = fine."""
        return []

    def artifact_in(self, directory: Path) -> Path | None:
        """What :meth:`load` loads for an export directory (e.g. onnxruntime-genai's), or None."""
        return None


#: the packages whose versions decide what an ExecuTorch program (.pte, and TorchChat's files) holds
EXECUTORCH_TOOLCHAIN = ("torch", "executorch", "torchao", "transformers")


def package_versions(*packages: str) -> dict[str, str]:
    """Installed versions for an artifact's manifest ("not installed" for a missing package)."""
    import importlib.metadata as md

    out = {}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the model or its tokenizer declares, for an artifact's metadata
    (ExecuTorch's ``get_eos_ids``, TorchChat's runner): generation config, model config, tokenizer."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None)
        ids.update([e] if isinstance(e, int) else (e or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(int(i) for i in ids)


# name -> "module:Class", imported on first use so that importing ``export`` stays cheap.
_EXPORTERS: dict[str, str] = {
    "executorch": "export.executorch:ExecuTorchExporter",
    "onnxruntime": "export.onnxruntime:OnnxRuntimeExporter",
    "torchchat": "export.torchchat:TorchChatExporter",
}


def exporter_names() -> list[str]:
    return sorted(_EXPORTERS)


def get_exporter(name: str) -> Exporter:
    try:
        target = _EXPORTERS[name]
    except KeyError:
        raise ExportError(f"unknown exporter {name!r}; available: {', '.join(exporter_names())}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


def exporter_for_artifact(path: Path) -> Exporter:
    """Pick the exporter whose runner loads ``path``: by file suffix, or for a directory the
    exporter that recognises it (:meth:`Exporter.artifact_in`)."""
    if Path(path).is_dir():
        for name in exporter_names():
            exp = get_exporter(name)
            if exp.artifact_in(Path(path)) is not None:
                return exp
        raise ExportError(f"no runtime loads the directory {path}; give the artifact file (.pte, .onnx...)")
    suffix = Path(path).suffix
    for name in exporter_names():
        exp = get_exporter(name)
        if suffix in exp.suffixes:
            return exp
    known = sorted({s for n in exporter_names() for s in get_exporter(n).suffixes})
    raise ExportError(f"no runtime loads {path} (suffix {suffix!r}); known suffixes: {', '.join(known)}")
