"""The API is quiet unless asked: nothing on fds 1 and 2, everything in <run>/pipeline.log."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from optimize import load_config, run_pipeline
from optimize.quiet import LogOutput, console

REPO = Path(__file__).resolve().parents[2]


def test_log_output_takes_fds_streams_handlers_and_c_stdio_and_restores(tmp_path, capfd):
    held = logging.StreamHandler(sys.stderr)  # a handler made earlier holds the old stream (transformers does)
    lg = logging.getLogger("test_quiet.held")
    lg.addHandler(held)
    lg.propagate = False
    libc = ctypes.CDLL(None)
    try:
        before = sys.stderr
        with LogOutput(tmp_path / "a.log") as q:
            print("python stdout")
            print("python stderr", file=sys.stderr)
            os.write(1, b"fd one\n")
            os.write(2, b"fd two\n")
            libc.printf(b"c printf buffered\n")  # C stdio: flushed on exit, before fd 1 is restored
            lg.warning("a logging record")
            console().write("to the console\n")  # the caller's own stream stays reachable
            q.move_to(tmp_path / "b.log")  # the run directory becomes known: same content, new place
            os.write(2, b"after the move\n")
        assert sys.stderr is before and held.stream is before
    finally:
        lg.removeHandler(held)
    out, err = capfd.readouterr()
    assert out == "" and err == "to the console\n"
    text = (tmp_path / "b.log").read_text()
    for line in ("python stdout", "python stderr", "fd one", "fd two", "c printf buffered", "a logging record",
                 "after the move"):
        assert line in text, line
    assert not (tmp_path / "a.log").exists()
    os.write(2, b"visible again\n")
    assert capfd.readouterr().err == "visible again\n"


def test_log_output_restores_on_an_exception(tmp_path, capfd):
    with pytest.raises(RuntimeError):
        with LogOutput(tmp_path / "x.log"):
            os.write(2, b"inside\n")
            raise RuntimeError("boom")
    os.write(2, b"outside\n")
    assert capfd.readouterr().err == "outside\n"
    assert (tmp_path / "x.log").read_text() == "inside\n"


def test_tiny_pipeline_writes_nothing_to_fds_and_everything_to_its_log(tiny_cfg, tmp_path, capfd):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.05}]
    cfg = load_config(tiny_cfg)
    capfd.readouterr()
    messages = []
    report = run_pipeline(cfg, say=messages.append)
    assert report.ok
    assert capfd.readouterr() == ("", "")
    log = (tmp_path / "run" / "pipeline.log").read_text()
    assert "loading model (random)" in log and "stage 0:test_noise: " in log and "report: " in log
    assert "baseline:" in log  # the eval bar went to the log, not the terminal
    assert messages[0] == "loading model (random)" and messages[-1].startswith("report: ")


@pytest.mark.slow
def test_executorch_pipeline_in_a_fresh_process_is_silent(tmp_path):
    """A fresh interpreter: torchao's import noise, torch/transformers warnings, ExecuTorch's C++
    cpuinfo lines (straight to fd 2) all land in pipeline.log; stdout and stderr stay empty."""
    from tests.conftest import TINY_CONFIGS

    cfg = {
        "version": 1, "name": "quiet", "target": "executorch", "output_dir": str(tmp_path / "run"),
        "model": {"source": "random", "config": dict(TINY_CONFIGS["llama"])},
        "data": {"eval_tokens": 256, "calibration_tokens": 128, "seq_len": 128},
        "checks": {"latency": {"runs": 1, "warmup": 0, "decode_tokens": 4, "prompt_tokens": 16, "threads": 1}},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    _silent_in_a_fresh_process(f"""
        from optimize import run_pipeline
        report = run_pipeline({str(path)!r})
        assert report.ok, report.stopped_at
    """, tmp_path)
    log = (tmp_path / "run" / "pipeline.log").read_text()
    assert "exporting to executorch" in log and "report: " in log
    assert "Failed to load" in log or "cpuinfo" in log  # the native / import noise that used to reach stderr
    assert (tmp_path / "run" / "export" / "executorch" / "model.pte").exists()


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_cli_in_a_pipe_prints_the_run_messages_but_not_the_library_noise(tmp_path):
    """``optimize pipeline`` with stderr not a terminal (make, CI, a pipe): the run's own messages
    reach the real stderr while they happen (the saved fd 2, not the redirected one), the library
    noise goes to pipeline.log, and the table to stdout."""
    from tests.conftest import TINY_CONFIGS

    cfg = {
        "version": 1, "name": "pipe", "output_dir": str(tmp_path / "run"),
        "model": {"source": "random", "config": dict(TINY_CONFIGS["llama"])},
        "data": {"eval_tokens": 256, "calibration_tokens": 128, "seq_len": 128},
        "checks": {"latency": {"enabled": False}},
        "stages": [{"kind": "ptq_int8", "scheme": "8da8w"}],
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("OPTIMIZE_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-m", "optimize.cli", "pipeline", str(path)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loading model" in proc.stderr and "stage 0:ptq_int8" in proc.stderr and "report: " in proc.stderr
    assert "Failed to load" not in proc.stderr and "| 0:ptq_int8 |" in proc.stdout
    assert "loading model" in (tmp_path / "run" / "pipeline.log").read_text()


@pytest.mark.slow
def test_the_embedded_api_writes_nothing_in_a_fresh_process(tmp_path):
    """The README's embedding: `load_config` then `run_pipeline(cfg)` in a fresh interpreter. The
    config's validation imports the stages (transformers, and torchao through it), whose import logs
    torchao's missing CUDA extensions and torch's pytree deprecations: none of that may reach the
    embedding application's stdout or stderr, before the run or during it."""
    _silent_in_a_fresh_process(f"""
        from optimize import load_config, run_pipeline
        cfg = load_config({str(REPO / "examples" / "tiny.yaml")!r})
        report = run_pipeline(cfg, output_dir={str(tmp_path / "run")!r})
        assert report.ok, report.stopped_at
    """, tmp_path)
    assert "report: " in (tmp_path / "run" / "pipeline.log").read_text()


def _silent_in_a_fresh_process(code: str, cwd) -> None:
    """Run ``code`` in a fresh interpreter (no test plugins): it must succeed and print nothing at all."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("OPTIMIZE_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "" and proc.stderr == "", (proc.stdout[-1000:], proc.stderr[-2000:])
