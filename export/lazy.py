"""Lazy public names for the runtime packages.

Why: ``export.executorch`` and its siblings name their exporter and runner at package level, but
importing a package must stay cheap and must not import torch or a runtime before the caller is
ready (the CLI sets ``MKL_NUM_THREADS`` first, see :mod:`export.executorch.blas_threads`). Each
package maps its public names to the submodule that defines them; the submodule is imported on
first access (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, public: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``public`` maps a name to its submodule."""

    def __getattr__(name: str) -> Any:
        try:
            module = public[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        from targets.quiet_imports import import_quietly

        import_quietly()  # a runtime package imports transformers and torchao: their import noise stays out
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(public)

    return __getattr__, __dir__
