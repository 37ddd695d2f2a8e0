"""bench/retiming.py: ratios against the reference row are paired within each timing round."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "retiming.py"


@pytest.fixture(scope="module")
def retiming():
    spec = importlib.util.spec_from_file_location("bench_retiming", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_paired_ratio_cancels_drift_that_a_ratio_of_medians_keeps(retiming):
    """The host halves every row's speed in some rounds: the within-round ratio stays 1.2 exactly,
    while the ratio of medians (rows disturbed in different rounds) does not."""
    S = retiming.Samples
    ref = S(prefill_ms=[100, 200, 100, 200, 100], decode_tok_s=[100, 50, 100, 50, 100])
    ours = S(prefill_ms=[80, 160, 80, 160, 80], decode_tok_s=[120, 60, 120, 60, 120])
    res = retiming.summarize({"ours": ours, "peer": ref}, reference="peer")
    assert res["ours"]["paired_x_ref"]["decode"] == pytest.approx(1.2, rel=1e-12)
    assert res["ours"]["paired_x_ref"]["prefill128"] == pytest.approx(0.8, rel=1e-12)
    assert res["peer"]["paired_x_ref"]["decode"] == pytest.approx(1.0)
    assert res["ours"]["decode_best"] == 120 and res["ours"]["prefill128_best"] == 80
    assert res["ours"]["decode_tok_s"] == 120 and res["ours"]["decode_samples"] == [120, 60, 120, 60, 120]
    assert "prefill512_ms" not in res["ours"]  # no long-prompt samples were taken

    # a disturbance that hits rows in different rounds: medians mislead, pairing does not hide it
    skewed = retiming.summarize({"ours": S(prefill_ms=[1, 1, 1], decode_tok_s=[60, 60, 120]),
                                 "peer": S(prefill_ms=[1, 1, 1], decode_tok_s=[100, 100, 50])}, reference="peer")
    assert skewed["ours"]["decode_tok_s"] / skewed["peer"]["decode_tok_s"] == pytest.approx(0.6)
    assert skewed["ours"]["paired_x_ref"]["decode"] == pytest.approx(0.6)


def test_without_reference_no_ratios(retiming):
    res = retiming.summarize({"a": retiming.Samples([10.0], [5.0], [40.0])})
    assert "paired_x_ref" not in res["a"] and res["a"]["prefill512_ms"] == 40.0


def test_host_monitor_reports_load_and_steal(retiming):
    mon = retiming.HostMonitor()
    sum(i * i for i in range(200_000))  # let some CPU time pass
    rep = mon.report()
    assert set(rep) == {"load_avg_start", "load_avg_end", "steal_pct"}
    assert rep["load_avg_start"] >= 0 and (rep["steal_pct"] is None or 0 <= rep["steal_pct"] <= 100)


def test_cpp_runner_samples_are_paired_when_every_round_has_them(retiming):
    """The C++ runner is timed in the same rounds: its medians and paired ratio appear beside the
    Python loop's; a row without C++ samples (a program the runner cannot run) gets no C++ ratio."""
    S = retiming.Samples
    ref = S(prefill_ms=[10, 20], decode_tok_s=[100, 50], cpp_prefill_ms=[9, 18], cpp_decode_tok_s=[200, 100])
    ours = S(prefill_ms=[8, 16], decode_tok_s=[110, 55], cpp_prefill_ms=[9, 9], cpp_decode_tok_s=[260, 110])
    bare = S(prefill_ms=[8, 16], decode_tok_s=[110, 55])
    res = retiming.summarize({"ours": ours, "bare": bare, "peer": ref}, reference="peer")
    assert res["ours"]["paired_x_ref"]["cpp_decode"] == pytest.approx((1.3 + 1.1) / 2)
    assert res["ours"]["paired_x_ref"]["cpp_prefill128"] == pytest.approx((1.0 + 0.5) / 2)
    assert res["ours"]["cpp_decode_tok_s"] == 185 and res["ours"]["cpp_decode_samples"] == [260, 110]
    assert "cpp_decode" not in res["bare"]["paired_x_ref"] and "cpp_decode_tok_s" not in res["bare"]
