"""Device profiles: every shipped one loads, a custom file works the same way, and mistakes name
the YAML path (an unknown profile lists the shipped ones and where they live)."""

from __future__ import annotations

import platform
import re

import pytest
import yaml

from targets.devices import DEVICE_DIR, DeviceError, DeviceProfile, device_names, load_device
from targets.profile import PROFILE_DIR, TargetError, load_target

PHONES_AND_BOARDS = ["pixel-8", "galaxy-s24", "iphone-15-pro", "android-midrange-6gb", "raspberry-pi-5",
                     "raspberry-pi-4", "jetson-orin-nano"]


def _custom(**over) -> dict:
    data = yaml.safe_load((DEVICE_DIR / "raspberry-pi-5.yaml").read_text())
    data.update(name="my-board", **over)
    return data


def test_the_shipped_profiles_are_the_ones_asked_for():
    assert set(PHONES_AND_BOARDS) | {"host"} == set(device_names())


@pytest.mark.parametrize("name", PHONES_AND_BOARDS)
def test_every_shipped_profile_loads_with_its_sources(name):
    d = load_device(name)
    assert isinstance(d, DeviceProfile) and d.name == name
    assert 0 < d.memory.usable_gib < d.memory.total_gib and d.memory.usable_basis
    assert 0 < d.bandwidth.practical_gb_s < d.bandwidth.theoretical_gb_s
    assert d.cores.total >= 4 and "neon" in d.isa and d.arch == "aarch64" and d.arch_level
    # the ISA floor and the features agree: LSE atomics from Armv8.1, dot product from Armv8.2
    v8_0 = d.arch_level == "armv8-a"
    assert ("lse" in d.isa) is not v8_0 and ("dotprod" in d.isa) is not v8_0
    if d.core_models is not None:  # each tier that has cores names its core, and only those
        for tier in ("big", "mid", "little"):
            assert (getattr(d.core_models, tier) is not None) == (getattr(d.cores, tier) > 0), (name, tier)
            assert getattr(d.core_models, tier) is None or getattr(d.core_models, tier).startswith("cortex-")
    assert {"executorch", "onnxruntime"} <= set(d.runtimes)
    text = (DEVICE_DIR / f"{name}.yaml").read_text()
    # each figure has a comment naming where it comes from, or saying it is an estimate/assumption
    for key in ("total_gib", "usable_gib", "storage_gib", "practical_fraction"):
        line = next(x for x in text.splitlines() if x.strip().startswith(key + ":"))
        assert "#" in line, f"{name}: {key} has no source comment"
    assert re.search(r"theoretical_gb_s", text) and ("ESTIMATE" in text or "spec" in text.lower())


def test_host_is_measured_here():
    d = load_device("host")
    assert d.kind == "host" and d.measured and "copy" in d.measured["bandwidth"]
    assert 0 < d.memory.usable_gib <= d.memory.total_gib and d.cores.big >= 1
    assert 1 < d.bandwidth.theoretical_gb_s < 2000 and d.bandwidth.practical_fraction == 1.0
    with open("/proc/cpuinfo") as fh:
        flags = fh.read()
    if " avx2" in flags:
        assert "avx2" in d.isa
    assert d.arch == {"arm64": "aarch64"}.get(platform.machine(), platform.machine())
    if " atomics" in flags:  # an arm64 host's LSE atomics under the profile's name
        assert "lse" in d.isa


def test_custom_file_loads_like_a_shipped_one(tmp_path):
    path = tmp_path / "board.yaml"
    path.write_text(yaml.safe_dump(_custom()))
    d = load_device(str(path))
    assert d.name == "my-board" and d.memory.total_gib == 8


def test_unknown_name_lists_the_profiles_and_their_folder():
    with pytest.raises(DeviceError) as err:
        load_device("pixel-9000")
    msg = str(err.value)
    assert "unknown device profile 'pixel-9000'" in msg and "raspberry-pi-5" in msg and "host" in msg
    assert str(DEVICE_DIR) in msg


def test_typo_key_names_the_yaml_path_and_the_close_key(tmp_path):
    data = _custom()
    data["memory"]["usable_gb"] = data["memory"].pop("usable_gib")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(DeviceError) as err:
        load_device(path)
    msg = str(err.value)
    assert str(path) in msg and "memory.usable_gb: unknown key 'usable_gb' (did you mean 'usable_gib'?)" in msg


@pytest.mark.parametrize("over, expect", [
    ({"memory": {"total_gib": 4, "usable_gib": 6, "usable_basis": "x"}}, "usable_gib 6.0 exceeds total_gib 4.0"),
    ({"isa": ["neon", "avx1024"]}, "isa.1"),
    ({"runtimes": {"tflite": "no"}}, "unknown target 'tflite'"),
    ({"bandwidth": {"theoretical_gb_s": 10, "practical_fraction": 1.5}}, "bandwidth.practical_fraction"),
])
def test_wrong_values_are_refused_with_their_path(tmp_path, over, expect):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_custom(**over)))
    with pytest.raises(DeviceError, match=re.escape(expect)):
        load_device(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DeviceError, match="device profile file not found"):
        load_device(tmp_path / "nope.yaml")


# ---- the ISA floor of a runtime build ---------------------------------------------------------


@pytest.mark.parametrize("target, refused", [("executorch", True), ("torchchat", True), ("onnxruntime", False)])
def test_an_armv8_0_board_is_refused_the_runtimes_that_need_lse(target, refused):
    pi4 = load_device("raspberry-pi-4")
    why = pi4.check_isa(load_target(target))
    if not refused:
        assert why is None
        return
    assert why.startswith(f"device 'raspberry-pi-4' (4x Cortex-A72 @ 1.8 GHz, armv8-a) cannot run target '{target}'")
    assert "lack lse" in why and "illegal instruction" in why and "use target onnxruntime" in why
    assert "\n" not in why  # one line


@pytest.mark.parametrize("name", [n for n in PHONES_AND_BOARDS if n != "raspberry-pi-4"])
def test_every_armv8_1_or_later_device_runs_every_target(name):
    d = load_device(name)
    assert all(d.check_isa(load_target(t)) is None for t in ("executorch", "torchchat", "onnxruntime"))


def test_an_x86_device_is_never_held_to_arm64_requirements(tmp_path):
    x86 = DeviceProfile.model_validate(_custom(isa=["avx2", "fma"], arch=None, arch_level=None, core_models=None))
    assert x86.arch == "x86_64"  # inferred from its x86-only features
    assert x86.check_isa(load_target("executorch")) is None


def test_a_custom_targets_requirement_names_its_yaml_path(tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "onnxruntime.yaml").read_text())
    good = tmp_path / "mine.yaml"
    good.write_text(yaml.safe_dump(dict(data, name="mine", requires_isa_aarch64={"i8mm": "our int8 kernels"})))
    why = load_device("raspberry-pi-5").check_isa(load_target(str(good)))
    assert why is not None and "lack i8mm" in why and "our int8 kernels" in why
    assert load_device("pixel-8").check_isa(load_target(str(good))) is None
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dict(data, name="bad", requires_isa_aarch64={"atomics": "a /proc/cpuinfo name"})))
    with pytest.raises(TargetError, match=r"requires_isa_aarch64\.atomics"):
        load_target(str(bad))


def test_validate_refuses_the_recipe_before_anything_runs(tiny_config, tmp_path, capsys):
    from optimize.cli import main

    cfg = {"version": 1, "name": "pi4", "stages": [], "device_profile": "raspberry-pi-4",
           "model": {"source": "random", "config": tiny_config("llama")}}
    path = tmp_path / "pi4.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["validate", str(path), "--target", "executorch"]) == 2
    problem = [line for line in capsys.readouterr().err.splitlines() if line.strip().startswith("device_profile:")]
    assert len(problem) == 1 and "cannot run target 'executorch'" in problem[0] and "lack lse" in problem[0]
    assert main(["validate", str(path), "--target", "onnxruntime"]) == 0
    assert "device: raspberry-pi-4" in capsys.readouterr().out
