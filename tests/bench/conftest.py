"""Load a bench script as a module the way it runs: each puts the repository root first on
sys.path when it loads (so ``bench/executorch.py`` cannot shadow the real package); undo that."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench_script(name: str):
    """Yield ``bench/<name>.py`` as a module, restoring ``sys.path`` afterwards (use in a fixture)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path[:] = saved
