"""The report files: JSON and Markdown always, the plot where matplotlib is there."""

from __future__ import annotations

import json
import logging
import sys

from optimize.report import Metrics, Report, StageRow, write_report


def _report() -> Report:
    rows = [StageRow(index=-1, name="baseline", kind="baseline", metrics=Metrics(perplexity=14.7, size_mb=513.0)),
            StageRow(index=0, name="0:ptq_int8", kind="ptq_int8", metrics=Metrics(perplexity=15.7, size_mb=252.0))]
    return Report(name="t", rows=rows)


def test_plot_is_drawn_beside_json_and_markdown(tmp_path):
    paths = write_report(_report(), tmp_path)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["json"].read_text())["rows"][1]["metrics"]["perplexity"] == 15.7
    assert "0:ptq_int8" in paths["md"].read_text()


def test_without_matplotlib_the_report_is_kept_and_the_plot_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    """A bare GPU image runs the stages without matplotlib: the finished run's report must survive."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with caplog.at_level(logging.WARNING, logger="optimize.report"):
        paths = write_report(_report(), tmp_path)
    assert "png" not in paths and not (tmp_path / "report.png").exists()
    assert json.loads(paths["json"].read_text())["name"] == "t"
    assert any("matplotlib is not installed" in r.getMessage() for r in caplog.records)
