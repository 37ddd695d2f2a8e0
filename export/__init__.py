"""Exporters to edge and server runtimes, each verified by loading its artifact back.

One package per runtime: :mod:`export.executorch`, :mod:`export.onnxruntime` and
:mod:`export.torchchat`, each with its exporter, recipes and runner. Beside them, the shared floor
that every runtime builds on: the exporter contract and registry (``base.py``), the runner
interface and the decoding loops (:mod:`export.decoding`), verification of an artifact against
eager (``verify.py``) and the exported-precision check (``precision.py``). A runtime package
imports the shared floor and, where it reuses another runtime (TorchChat's ``.pte``), only that
package's public names. This package imports nothing heavy on its own.
"""

from export.base import ExportError, ExportOptions, ExportResult, Exporter, exporter_names, get_exporter
from export.decoding.runtime import EagerRunner, Runner, RunnerError, greedy_generate

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
