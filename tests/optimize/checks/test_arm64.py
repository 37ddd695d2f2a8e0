"""``checks.arm64`` in a pipeline: each export row run in the ARM64 build of its runtime on the
device profile's core, its result in the report and its ``arm64`` gate; and the refusals that
``optimize validate`` gives before any stage runs."""

from __future__ import annotations

import pytest

from optimize import load_config, run_pipeline
from optimize.checks.arm64 import arm64_gates, cores, runnable
from optimize.checks.arm64_config import Arm64Check
from optimize.errors import ConfigError
from targets.devices import load_device


def test_cores_come_from_the_config_then_the_device():
    assert cores(Arm64Check(), None) == ["cortex-a76"]
    assert cores(Arm64Check(), load_device("raspberry-pi-4")) == ["cortex-a72"]
    assert cores(Arm64Check(), load_device("pixel-8")) == ["max"]
    assert cores(Arm64Check(), load_device("host")) == ["cortex-a76"]
    assert cores(Arm64Check(cpus=["max", "cortex-a72"]), load_device("raspberry-pi-5")) == ["max", "cortex-a72"]


def test_runnable_artifacts(tmp_path):
    assert runnable(tmp_path / "m.pte") and runnable(tmp_path / "model.onnx") and runnable(tmp_path / "genai_config.json")
    assert not runnable(tmp_path / "model.pt2") and not runnable(tmp_path / "model.pth")


def test_gates_fail_on_a_failed_or_diverging_run_and_skip_what_has_no_arm_runtime():
    where = "aarch64 (emulated, cortex-a72)"
    ok = {"verified": True, "cpu": "cortex-a72", "where": where, "greedy": [{"equal": True}],
          "perplexity": {"ok": True, "rel_diff_pct": 0.1, "tolerance_pct": 1.0}}
    died = {"verified": False, "cpu": "cortex-a72", "where": where, "failure": "SIGILL here"}
    diverged = {**ok, "verified": False, "greedy": [{"equal": False, "first_divergence": 3, "host_gap": 2.0,
                                                     "tie_threshold": 0.1, "near_tie": False}]}
    skipped = {"verified": None, "skipped": "no ARM64 runtime check for model.pt2"}
    gates = arm64_gates([ok, died, diverged, skipped])
    assert [g.ok for g in gates] == [True, False, False]
    assert "SIGILL here" in gates[1].message and "diverges at step 3 (gap 2.0 > 0.1)" in gates[2].message


def test_bad_cpu_is_refused_with_the_choices(tiny_cfg):
    tiny_cfg["checks"]["arm64"] = {"cpus": ["cortex-a53"]}
    with pytest.raises(ConfigError, match=r"checks\.arm64\.cpus\.0.*'cortex-a72', 'cortex-a76' or 'max'"):
        load_config(tiny_cfg)
    tiny_cfg["checks"]["arm64"] = {"windows": 1, "window": 64}
    with pytest.raises(ConfigError, match=r"checks\.arm64\.window"):
        load_config(tiny_cfg)


def test_validate_refuses_without_the_environment(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_ARM64_HOME", str(tmp_path / "none"))
    tiny_cfg["checks"]["arm64"] = {}
    with pytest.raises(ConfigError, match=r"checks\.arm64: the ARM64 environment is not set up.*optimize setup arm64"):
        load_config(tiny_cfg)


@pytest.mark.slow
@pytest.mark.minutes(1.5)
def test_pipeline_verifies_onnx_rows_on_the_pi4_core(arm64_env, tiny_cfg):
    """ONNX Runtime and onnxruntime-genai run on an Armv8.0 Cortex-A72, where ExecuTorch cannot:
    the Raspberry Pi 4's artifact, proven in its runtime's ARM64 build."""
    tiny_cfg["checks"]["arm64"] = {"prompts": 1, "prompt_tokens": 8, "new_tokens": 8, "windows": 1, "window_tokens": 64}
    tiny_cfg["device_profile"] = "raspberry-pi-4"
    tiny_cfg["checks"]["memory"] = True  # the device gates need the measured peak
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da8w"}]
    report = run_pipeline(load_config(tiny_cfg), target="onnxruntime", say=lambda m: None)
    assert report.ok, report.rows[-1].gates
    rows = [r for r in report.rows if r.name.startswith("export:")]
    assert {r.runtime for r in rows} == {"onnxruntime", "onnxruntime-genai"}
    for row in rows:
        (rep,) = row.metrics.arm64
        assert rep["verified"] and rep["cpu"] == "cortex-a72" and rep["stands_for"] == "cortex-a72"
        assert rep["runtime"] == row.runtime and rep["guest"]["machine"] == "aarch64"
        (gate,) = [g for g in row.gates if g.metric == "arm64"]
        assert gate.ok and "verified on aarch64 (emulated, cortex-a72" in gate.message


def test_the_config_names_every_emulated_core():
    from typing import get_args

    from optimize.checks.arm64_config import CpuName
    from targets.arm64.cpus import CPUS

    assert set(get_args(CpuName)) == set(CPUS)
