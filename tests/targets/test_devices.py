"""Device profiles: every shipped one loads, a custom file works the same way, and mistakes name
the YAML path (an unknown profile lists the shipped ones and where they live)."""

from __future__ import annotations

import re

import pytest
import yaml

from targets.devices import DEVICE_DIR, DeviceError, DeviceProfile, device_names, load_device

PHONES_AND_BOARDS = ["pixel-8", "galaxy-s24", "iphone-15-pro", "android-midrange-6gb", "raspberry-pi-5",
                     "jetson-orin-nano"]


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
    assert d.cores.total >= 4 and "neon" in d.isa and "dotprod" in d.isa
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
