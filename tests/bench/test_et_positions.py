"""bench/et_positions.py: decode steps of several programs at several positions, paired in one process."""

from __future__ import annotations

import shutil

import pytest

from tests.bench.conftest import load_bench_script


@pytest.fixture(scope="module")
def et_positions():
    yield from load_bench_script("et_positions")


def test_table_has_a_ratio_column_per_program_after_the_first(et_positions):
    res = {"ptes": ["/a/model.pte", "/b/x.pte"],
           "positions": {10: [{"ms": 3.0, "ratio": 1.0}, {"ms": 3.3, "ratio": 1.1}]}}
    lines = et_positions.table(res).splitlines()
    assert lines[0] == "| position | a ms | x.pte ms | x.pte / a |"
    assert lines[1].count("---:") == 4 and lines[2] == "| 10 | 3.00 | 3.30 | 1.100 |"


def test_bad_arguments_are_refused(et_positions, tmp_path):
    with pytest.raises(ValueError, match="at least one .pte"):
        et_positions.sweep([], [10])
    with pytest.raises(ValueError, match="positions must be >= 0"):
        et_positions.sweep([tmp_path / "a.pte"], [-1])
    with pytest.raises(FileNotFoundError, match="no .pte at"):
        et_positions.sweep([tmp_path / "missing.pte"], [10], steps=1, rounds=1)


@pytest.mark.slow
def test_sweep_of_a_tiny_program_against_its_copy(et_positions, tiny_llama, tmp_path):
    """Two copies of one real program: every position timed for both, ratios near 1, and a position
    past the cache is a clear error."""
    from export.executorch.exporter import ExecuTorchOptions, lower_to_pte

    class Tok:
        bos_token_id, eos_token_id, vocab_file = 1, 2, ""

    data, _ = lower_to_pte(tiny_llama, Tok(), ExecuTorchOptions(max_seq_len=64), log=lambda *_: None)
    a = tmp_path / "a.pte"
    a.write_bytes(data)
    b = tmp_path / "b.pte"
    shutil.copy(a, b)
    import torch

    threads = torch.get_num_threads()
    res = et_positions.sweep([a, b], [0, 20, 62], steps=5, rounds=5, threads=1)
    assert torch.get_num_threads() == threads  # the sweep's one intra-op thread is put back
    assert list(res["positions"]) == [0, 20, 62]
    for cells in res["positions"].values():
        assert len(cells) == 2 and all(c["ms"] > 0 for c in cells)
        assert cells[0]["ratio"] == 1.0
        # a copy of the same program: a ratio an order of magnitude off 1 means the pairing is broken;
        # what the ratio is beyond that is the host's noise, a benchmark's business, not a test's
        # (two busy CI workers gave 0.24 once, with 0.5-2.0 asserted here)
        assert 0.1 < cells[1]["ratio"] < 10.0
    with pytest.raises(RuntimeError, match="position 64 failed.*max_seq_len"):
        et_positions.sweep([a], [64], steps=1, rounds=1, threads=1)
