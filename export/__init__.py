"""Exporters to edge and server runtimes, each verified by loading its artifact back.

Import submodules explicitly (``export.executorch``, ``export.onnxruntime``); this package
imports nothing heavy on its own.
"""

from export.base import ExportError, ExportOptions, ExportResult, Exporter, exporter_names, get_exporter
from export.runtime import EagerRunner, Runner, RunnerError, greedy_generate

__all__ = [
    "EagerRunner",
    "ExportError",
    "ExportOptions",
    "ExportResult",
    "Exporter",
    "Runner",
    "RunnerError",
    "exporter_names",
    "get_exporter",
    "greedy_generate",
]
