"""How a row joins the report: gated against its goals, or as the error that stopped the run.

One place for both because the stages' loop and the export step end a row the same way: its gate
results and status, its wall time, the report's ``ok`` and ``stopped_at`` when it stops the run,
and one line for the user (the traceback only with ``-v``: it belongs in no report).
"""

from __future__ import annotations

import logging
import time

from optimize.gates import evaluate_gates
from optimize.gates_config import GatesConfig
from optimize.report import Metrics, Report, StageRow

log = logging.getLogger("optimize")


def record_error(report: Report, row: StageRow, exc: Exception, t0: float, say) -> None:
    """A stage or export raised: record it, stop the run, keep the last good model."""
    row.status, row.error = "error", f"{type(exc).__name__}: {exc}"
    row.wall_s = time.perf_counter() - t0
    report.rows.append(row)
    report.ok, report.stopped_at = False, row.name
    # one clear line for the user; the traceback only with -v (INFO), it is in no report
    log.info("%s failed", row.name, exc_info=exc)
    say(f"{row.name} failed: {row.error}; last good model kept at {report.last_good_artifact}")


def record_gated(report: Report, row: StageRow, gates: GatesConfig, baseline: Metrics, t0: float, say,
                  extra=()) -> bool:
    """Evaluate the row's gates (and ``extra`` results, the device's) and append it; False when a
    failed gate stops the run."""
    row.gates = evaluate_gates(gates, row.metrics, baseline) + list(extra)
    row.status = row_status(row.gates, gates)
    row.wall_s = time.perf_counter() - t0
    report.rows.append(row)
    if row.status != "fail":
        return True
    report.ok, report.stopped_at = False, report.stopped_at or row.name
    say(f"{row.name} failed its gates: " + "; ".join(g.message for g in row.gates if not g.ok))
    return False


def row_status(results, gates: GatesConfig) -> str:
    if all(g.ok for g in results):
        return "pass"
    return "warn" if gates.on_fail == "warn" else "fail"
