"""kill -9 a real `optimize pipeline` process during stage 2; the re-run resumes there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).parent


def _env():
    env = dict(os.environ)
    env["OPTIMIZE_PLUGINS"] = "stage_plugins"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow  # a pipeline killed mid-stage, then resumed (about 15 s)
@pytest.mark.timeout(300)
def test_kill_during_stage_then_resume(tiny_cfg, tmp_path):
    marker = tmp_path / "stage2-started"
    tiny_cfg["stages"] = [
        {"kind": "test_noise", "scale": 0.01},
        {"kind": "test_noise", "scale": 0.01},
        {"kind": "test_sleep", "seconds": 120, "marker": str(marker)},
    ]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    cmd = [sys.executable, "-m", "optimize.cli", "pipeline", str(path)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "stage 2 never started"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    stages = sorted(p.name for p in (tmp_path / "run" / "stages").iterdir() if not p.name.startswith("."))
    assert len(stages) == 2 and stages[0].startswith("00-") and stages[1].startswith("01-")

    done = subprocess.run(cmd + ["stages.2.seconds=0"], env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "resuming: stages 0..1 finished in an earlier run" in done.stderr
    assert "starting at stage 2" in done.stderr
    assert "| 0:test_noise | eager |" in done.stdout and "| resumed |" in done.stdout
    assert "| 2:test_sleep | eager |" in done.stdout
