"""MKL stays serial on ExecuTorch's workers; eager torch keeps its threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from export.executorch import blas_threads


def test_sets_mkl_serial_and_keeps_omp_threads():
    env = {"OMP_NUM_THREADS": "3"}
    assert blas_threads.serial_mkl_env(env) == 3
    assert env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "1"}


@pytest.mark.parametrize("omp", [None, "", "x", "0"])
def test_without_a_usable_omp_setting_eager_keeps_every_cpu(omp):
    env = {} if omp is None else {"OMP_NUM_THREADS": omp}
    assert blas_threads.serial_mkl_env(env) == len(os.sched_getaffinity(0))
    assert env["MKL_NUM_THREADS"] == "1"


def test_a_users_mkl_setting_is_left_alone():
    env = {"MKL_NUM_THREADS": "4"}
    assert blas_threads.serial_mkl_env(env) is None
    assert env == {"MKL_NUM_THREADS": "4"}


def test_mkl_is_serial_on_every_thread_inside_serial_torch_and_restored_after():
    """Inside serial_torch MKL runs one thread on the calling thread and on a thread with no count of its own (an
    ExecuTorch worker), whatever the environment said; after it, both counts are back."""
    import threading

    import torch

    mkl = blas_threads.process_mkl()
    assert mkl is not None, "this torch build has MKL: its process-wide setter must be found"

    def on_new_thread() -> int:
        out = []
        t = threading.Thread(target=lambda: out.append(int(mkl._get())))
        t.start()
        t.join()
        return out[0]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    mkl.set(2)
    default = mkl.default
    mkl.default = 2  # as a process started without MKL_NUM_THREADS on 2 cores
    try:
        assert on_new_thread() == 2
        with blas_threads.serial_torch():
            assert torch.get_num_threads() == 1 and on_new_thread() == 1
        assert torch.get_num_threads() == 2 and on_new_thread() == 2
    finally:
        mkl.default = default
        mkl.set(default)
        torch.set_num_threads(before)


def test_a_torch_whose_mkl_cannot_be_made_serial_is_refused_in_one_line(monkeypatch):
    from export.decoding.runtime import RunnerError

    monkeypatch.setattr(blas_threads, "process_mkl", lambda: None)
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    with pytest.raises(RunnerError, match="set MKL_NUM_THREADS=1 before importing torch"):
        blas_threads.require_serial_mkl()
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    blas_threads.require_serial_mkl()


def test_cli_sets_it_before_torch_and_keeps_eager_threads():
    """In a fresh process, as a user runs the CLI: MKL serial, torch's intra-op threads from
    OMP_NUM_THREADS (torch alone would take MKL_NUM_THREADS=1 as its own default)."""
    code = ("import os, sys; from optimize.cli import main; rc = main(['ls', 'targets']); import torch; "
            "print('RESULT', rc, os.environ['MKL_NUM_THREADS'], torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "MKL_NUM_THREADS"}
    env["OMP_NUM_THREADS"] = "2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[3])  # the repository root
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
    assert line == ["RESULT 0 1 2"], out.stdout + out.stderr


def test_serial_torch_runs_at_one_thread_and_restores():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with blas_threads.serial_torch():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), blas_threads.serial_torch():
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
