"""Which emulated core stands for each device profile, and the Arm identity its guest sees."""

from __future__ import annotations

import pytest

from targets.arm64 import cpus
from targets.devices import list_devices, load_device


def test_every_arm_profile_gets_the_oldest_core_with_its_features():
    arm = [d for d in list_devices() if d.arch == "aarch64"]
    assert len(arm) >= 6
    order = list(cpus.CPUS)
    for device in arm:
        core, stands_for = cpus.cpu_for_device(device)
        assert set(device.isa) - {"sme"} <= core.isa, device.name
        # no older emulated core has every feature: the device's kernels, not a faster core's
        assert all(not set(device.isa) <= cpus.CPUS[older].isa for older in order[: order.index(core.name)]), device.name
        assert stands_for


@pytest.mark.parametrize("name, core, stands_for", [
    ("raspberry-pi-4", "cortex-a72", "cortex-a72"),
    ("raspberry-pi-5", "cortex-a76", "cortex-a76"),
    ("jetson-orin-nano", "cortex-a76", "cortex-a78ae"),  # QEMU 7.2 has no A78AE; same Armv8.2 features
    ("pixel-8", "max", "cortex-x3 / cortex-a715 / cortex-a510"),
    ("android-midrange-6gb", "cortex-a76", "cortex-a78 / cortex-a55"),
])
def test_named_devices(name, core, stands_for):
    got, who = cpus.cpu_for_device(load_device(name))
    assert (got.name, who) == (core, stands_for)


def test_the_pi4_core_has_no_lse_and_max_has_sme_off():
    assert "lse" not in cpus.CPUS["cortex-a72"].isa and "atomics" not in cpus.CPUS["cortex-a72"].hwcaps.split()
    assert "atomics" in cpus.CPUS["cortex-a76"].hwcaps.split()
    assert cpus.CPUS["max"].qemu == "max,sme=off"  # QEMU 7.2's SME breaks ONNX Runtime's int8 decode


def test_x86_profiles_and_unknown_cores_are_refused():
    with pytest.raises(cpus.CpuError, match="not an Arm64 device"):
        cpus.cpu_for_device(load_device("host"))
    with pytest.raises(cpus.CpuError, match="cortex-a72, cortex-a76, max"):
        cpus.resolve_cpu("cortex-a99")
    assert cpus.resolve_cpu("raspberry-pi-4").name == "cortex-a72"
    with pytest.raises(cpus.CpuError, match="no emulated Arm core has sve3"):
        cpus.cpu_for_isa(["neon", "sve3"])


def test_cpuinfo_is_arm_format_with_the_core_midr():
    text = cpus.cpuinfo_text(cpus.CPUS["cortex-a76"], cores=2)
    assert text.count("processor\t:") == 2
    fields = dict(line.split(":", 1) for line in text.splitlines()[1:8])
    assert fields["CPU implementer\t"].strip() == "0x41" and fields["CPU part\t"].strip() == "0xd0b"
    assert fields["CPU variant\t"].strip() == "0x4" and fields["CPU revision\t"].strip() == "1"
    a72 = dict(line.split(":", 1) for line in cpus.cpuinfo_text(cpus.CPUS["cortex-a72"]).splitlines()[1:8])
    assert a72["CPU part\t"].strip() == "0xd08"
