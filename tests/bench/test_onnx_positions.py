"""bench/onnx_positions.py: one-token steps of several onnxruntime-genai folders at several positions,
paired in one process, and the verification calls of those that verify."""

from __future__ import annotations

import pytest

from tests.bench.conftest import load_bench_script


@pytest.fixture(scope="module")
def onnx_positions():
    yield from load_bench_script("onnx_positions")


def test_table_has_ratios_and_the_verification_calls(onnx_positions):
    res = {"folders": ["/runs/a/export/onnxruntime", "/b"],
           "positions": {50: [{"ms": 5.0, "ratio": 1.0}, {"ms": 5.5, "ratio": 1.1}]},
           "verify_calls": {"/b": {50: {2: 1.3, 3: 1.6}}}}
    lines = onnx_positions.table(res).splitlines()
    assert lines[0] == "| position | a ms | b ms | b / a |" and lines[2] == "| 50 | 5.00 | 5.50 | 1.100 |"
    assert "b: a verification call of T tokens, in its one-token steps" in lines
    assert lines[-1] == "| 50 | 1.30 | 1.60 |"


def test_bad_arguments_are_refused(onnx_positions, tmp_path):
    with pytest.raises(ValueError, match="at least one folder"):
        onnx_positions.sweep([], [10])
    with pytest.raises(ValueError, match="positions must be >= 1"):
        onnx_positions.sweep([tmp_path], [0])
    with pytest.raises(FileNotFoundError, match="no onnxruntime-genai folder"):
        onnx_positions.sweep([tmp_path], [10], steps=1, rounds=1)


def test_sweep_of_a_tiny_export_with_and_without_verification(onnx_positions, tiny_llama, smollm2_tokenizer, tmp_path):
    """The same tiny model exported twice: both timed at every position, only the verifying one has call
    costs, one for each length from 2 to its verify_tokens."""
    from export.onnxruntime.exporter import OnnxRuntimeExporter

    folders = []
    for name, opts in (("plain", {"max_seq_len": 128}), ("verify", {"max_seq_len": 128, "verify_tokens": 3})):
        res = OnnxRuntimeExporter().export(tiny_llama, smollm2_tokenizer, tmp_path / name, opts, log=lambda *_: None)
        folders.append(res.artifact.parent)
    out = onnx_positions.sweep(folders, [20, 60], steps=2, rounds=1, threads=1)
    assert set(out["positions"]) == {20, 60} and all(len(v) == 2 and v[0]["ratio"] == 1.0 and v[1]["ms"] > 0
                                                    for v in out["positions"].values())
    assert list(out["verify_calls"]) == [str(folders[1])]
    assert all(set(c) == {2, 3} and min(c.values()) > 0 for c in out["verify_calls"][str(folders[1])].values())
