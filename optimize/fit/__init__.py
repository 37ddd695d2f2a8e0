"""``optimize fit``: the recipes a device can hold, searched by their price in bytes, the finalists
measured, the winner written as a pipeline YAML.

:mod:`~optimize.fit.search` runs the search; :mod:`~optimize.fit.stages` reuses the YAML's finished
stages; :mod:`~optimize.fit.depth` adds depth pruning with healing; :mod:`~optimize.fit.quality`
and :mod:`~optimize.fit.export` measure the finalists (eager, then in ExecuTorch);
:mod:`~optimize.fit.plot` draws them. What a recipe costs on a device is
:mod:`optimize.footprint`'s.
"""

from optimize.fit.search import FitRefused, FitResult, fit

__all__ = ["FitRefused", "FitResult", "fit"]
