"""The first import of the libraries that print on import, done once with that noise dropped.

On a CPU machine, importing torchao (which transformers' modeling code imports through its
quantizers) logs that its CUDA extensions failed to load and that Triton is missing, and torch
logs two pytree deprecations about torchao's enums: four lines on stderr, harmless and nothing the
user can act on. An embedding application that calls ``optimize.load_config`` and
``run_pipeline(progress=False)`` must see nothing on its stdout or stderr (the README's promise),
and the CLI must print only its own lines. So the API's entry points (the stage registry, the
exporters' lazy loader) import these libraries once through :func:`import_quietly`, with exactly
the loggers that make that noise (``torchao`` and its children, ``torch.utils._pytree``) raised to
ERROR for the length of the import and put back after it: nothing of the process's logging
changes, and warnings those libraries give later, while working, still show.
"""

from __future__ import annotations

import functools
import logging
import warnings

#: the loggers whose import-time warnings are dropped
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@functools.lru_cache(maxsize=1)
def import_quietly() -> None:
    """Import transformers' modeling code (and so torchao) once, with its import noise dropped."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformers.modeling_utils  # noqa: F401  (imports torchao through transformers' quantizers)
            try:
                import torchao  # noqa: F401
            except ImportError:  # an install without torchao: nothing of it to quiet
                pass
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
