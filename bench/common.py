"""Pieces the bench scripts share: a ``.pte`` loaded through ExecuTorch's pybindings, a measurement run in a child process that writes its result as
JSON (so that one configuration's peak memory or crash cannot touch the next), the table row of a
measurement that failed, and the end of a script's main (print the table, keep the JSON).

Scripts import it as ``bench.common``: each puts the repository root on ``sys.path`` first."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]


def run_json_child(cmd: Sequence[str], out: Path, env: Mapping[str, str], timeout: float, *,
                   tail: int = 160) -> dict[str, Any]:
    """Run ``cmd`` in the repository root; its result is the JSON it wrote to ``out``, plus
    ``wall_s``. A timeout or a failure becomes ``{"error": ...}`` with stderr's last line."""
    t0 = time.time()
    try:
        proc = subprocess.run(list(cmd), cwd=REPO, env=dict(env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0 or not Path(out).exists():
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"failed ({proc.returncode}): {last[:tail]}"}
    return {**json.loads(Path(out).read_text()), "wall_s": time.time() - t0}


def failed_row(label: str, error: str, empty_cells: int, *, width: int = 150) -> str:
    """A Markdown table row for a measurement that failed: the label, the error, empty cells."""
    return f"| {label} | failed: {error[:width]} |" + " |" * empty_cells


def print_results(header: str, table: str, results: Any, json_path: Path | None) -> int:
    """Print ``header`` and ``table``; write ``results`` to ``json_path`` when given. Returns 0."""
    print(header)
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def positions_table(names: list[str], positions: dict) -> list[str]:
    """Markdown rows of ms per step by position for several artifacts (``positions``: position -> one
    ``{"ms", "ratio"}`` per artifact), with each ratio to the first (bench/et_positions.py, bench/onnx_positions.py)."""
    head = ["position", *(f"{n} ms" for n in names), *(f"{n} / {names[0]}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for pos, cells in positions.items():
        row = [str(pos), *(f"{c['ms']:.2f}" for c in cells), *(f"{c['ratio']:.3f}" for c in cells[1:])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def parse_positions(ap, text: str) -> list[int]:
    """``--positions``' comma-separated integers; a clear argparse error otherwise."""
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        ap.error(f"--positions takes comma-separated integers, got {text!r}")


def load_pte_module(pte: str | Path, threads: int, **load_kwargs: Any):
    """``pte`` loaded through ExecuTorch's pybindings (the module the profilers time), with the kernels
    it needs registered first and ExecuTorch's threadpool at ``threads``."""
    import executorch.kernels.quantized  # noqa: F401  (quantized embedding kernels)
    from executorch.extension.pybindings import portable_lib

    from export.executorch.runner import uses_llama_custom_ops, load_llama_custom_ops, set_threads

    pte = Path(pte)
    if not pte.is_file():
        raise FileNotFoundError(f"no .pte at {pte}")
    if uses_llama_custom_ops(pte):
        load_llama_custom_ops()
    set_threads(threads)
    return portable_lib._load_for_executorch(str(pte), **load_kwargs)
