"""``optimize fit``'s plot: what each measured recipe costs in accuracy against its predicted speed.

Written as ``fit.png`` beside ``fit.md``: perplexity change (the heuristic penalty where nothing was
measured) on y, the PREDICTED decode ceiling on x, marker area by memory, the winner starred and the
decode floor dashed, so the Pareto front and the budget read at a glance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from targets.atomic import atomic_write_bytes


def render(result: Any, path: Path) -> Path | None:
    """Perplexity change (measured; the heuristic penalty where nothing was measured) against the
    predicted decode ceiling, marker area by memory, depth-pruned recipes as triangles; the winner
    starred. None without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - a pinned dependency
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in result.rows if r.measured]
    pts = measured or result.rows
    fig, ax = plt.subplots(figsize=(7, 4.5))
    peak = max(r.memory_bytes for r in pts)
    for fits, colour, name in ((True, "tab:green", "fits"), (False, "tab:red", "misses a budget")):
        for pruned, marker in ((False, "o"), (True, "^")):  # depth-pruned recipes as triangles
            sel = [r for r in pts if r.fits == fits and (getattr(r, "depth", None) is not None) == pruned]
            if sel:
                ax.scatter([r.decode_ceiling_tok_s for r in sel],
                           [r.perplexity_delta_pct if measured else r.quality_penalty for r in sel],
                           s=[30 + 300 * r.memory_bytes / peak for r in sel], c=colour, alpha=0.6, marker=marker,
                           label=name + (", depth-pruned" if pruned else ""))
    w = result.winner
    if w is not None:
        ax.scatter([w.decode_ceiling_tok_s], [w.perplexity_delta_pct if measured else w.quality_penalty],
                   marker="*", s=300, c="black", label=f"winner: {w.label()}")
    floor = (result.budgets or {}).get("decode_tok_s")
    if floor:
        ax.axvline(floor, ls="--", c="grey", lw=1)
    ax.set_xlabel("decode tok/s, PREDICTED (bandwidth ceiling)")
    ax.set_ylabel("perplexity change %, measured (short eval)" if measured else "quality penalty (heuristic)")
    ax.set_title(f"optimize fit: {result.device} (marker area: memory)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
