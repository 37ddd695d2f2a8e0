"""Which CPU QEMU emulates for a device, and what that CPU looks like from inside the guest.

QEMU 7.2 (Debian 12) emulates a handful of Arm cores. A device profile names its cores
(``core_models``) and the ISA features they share (``isa``); the check runs on the named core
where QEMU has it, else on the emulated core whose features are the smallest superset of the
profile's, and says which. ``max`` stands for the Armv9 phone cores (i8mm, bf16, SVE2); its SME is
switched off because QEMU 7.2 emulates SME wrongly (ONNX Runtime's int8 decode gives garbage with
it on, correct with it off and on QEMU 10).

Libraries in the guest read ``/proc/cpuinfo`` and the MIDR register file in sysfs to identify the
core (PyTorch's cpuinfo and oneDNN's xbyak_aarch64; QEMU 7.2 passes the host's x86 ``cpuinfo``
through, on which ``import torch`` crashes), so :func:`cpuinfo_text` and :data:`EmulatedCpu.midr`
give each guest an Arm-format view of the core it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

from targets.devices import DeviceProfile


@dataclass(frozen=True)
class EmulatedCpu:
    """One CPU model QEMU emulates: its ``-cpu`` value, the ISA features (as :mod:`targets.isa`
    names them) the guest sees, and the identity the guest's ``/proc/cpuinfo`` reports."""

    name: str
    qemu: str
    isa: frozenset[str]
    hwcaps: str  # /proc/cpuinfo "Features" (kernel HWCAP names)
    midr: int
    arch_level: str

    def describe(self, stands_for: str | None = None) -> str:
        """``cortex-a76 for cortex-a78ae (armv8.2-a, QEMU -cpu cortex-a76)``"""
        who = f" for {stands_for}" if stands_for and stands_for != self.name else ""
        return f"{self.name}{who} ({self.arch_level}, QEMU -cpu {self.qemu})"


_V80 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"
_V82 = _V80 + " atomics fphp asimdhp asimdrdm lrcpc dcpop asimddp"
#: the emulated cores, oldest ISA first (the order :func:`cpu_for_isa` searches)
CPUS: dict[str, EmulatedCpu] = {
    "cortex-a72": EmulatedCpu("cortex-a72", "cortex-a72", frozenset({"neon"}), _V80, 0x410FD083, "armv8-a"),
    "cortex-a76": EmulatedCpu("cortex-a76", "cortex-a76", frozenset({"neon", "lse", "fp16", "dotprod"}), _V82,
                              0x414FD0B1, "armv8.2-a"),
    "max": EmulatedCpu("max", "max,sme=off",
                       frozenset({"neon", "lse", "fp16", "dotprod", "i8mm", "bf16", "sve", "sve2"}),
                       _V82 + " sha3 sm3 sm4 asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve sve2 "
                       "sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh rng bti",
                       0x000F0510, "armv9-a, SME off"),
}
#: cores profiles name -> the emulated core that stands for them when QEMU lacks the model itself
ALIASES = {"raspberry-pi-4": "cortex-a72", "raspberry-pi-5": "cortex-a76", "neoverse-n1": "cortex-a76"}


class CpuError(ValueError):
    """A CPU name no emulated core stands for."""


def cpu_names() -> list[str]:
    return list(CPUS)


def cpu_for_isa(isa) -> EmulatedCpu:
    """The oldest emulated core that has every feature in ``isa``: the one whose kernels are the
    device's (a core with extra features would run faster paths the device never takes)."""
    want = set(isa) - {"sme"}  # nothing here emulates SME correctly; the runtimes dispatch without it
    for cpu in CPUS.values():
        if want <= cpu.isa:
            return cpu
    missing = sorted(want - CPUS["max"].isa)
    raise CpuError(f"no emulated Arm core has {', '.join(missing)}")


def resolve_cpu(name: str) -> EmulatedCpu:
    """An emulated core by its name (``cortex-a76``, ``max``) or by an alias."""
    key = ALIASES.get(name, name)
    if key in CPUS:
        return CPUS[key]
    raise CpuError(f"unknown CPU {name!r}; emulated: {', '.join(CPUS)} (or a device profile: --device-profile)")


def cpu_for_device(profile: DeviceProfile) -> tuple[EmulatedCpu, str]:
    """The emulated core for a device, and the device's cores it stands for (``cortex-x3 /
    cortex-a715 / cortex-a510``): the named core where QEMU has it, else the oldest emulated core
    with every feature the profile lists."""
    if profile.arch != "aarch64":
        raise CpuError(f"device {profile.name!r} is {profile.arch}, not an Arm64 device")
    cores = []
    if profile.core_models is not None:
        cores = [c for c in profile.core_models.model_dump().values() if c]
    stands_for = " / ".join(dict.fromkeys(cores)) or profile.cpu
    if len(set(cores)) == 1 and cores[0] in CPUS:
        return CPUS[cores[0]], stands_for
    return cpu_for_isa(profile.isa), stands_for


def cpuinfo_text(cpu: EmulatedCpu, cores: int = 1) -> str:
    """An Arm-format ``/proc/cpuinfo`` for ``cores`` cores of ``cpu``."""
    midr = cpu.midr
    block = (f"BogoMIPS\t: 50.00\nFeatures\t: {cpu.hwcaps}\nCPU implementer\t: 0x{midr >> 24 & 0xFF:02x}\n"
             f"CPU architecture: 8\nCPU variant\t: 0x{midr >> 20 & 0xF:x}\nCPU part\t: 0x{midr >> 4 & 0xFFF:03x}\n"
             f"CPU revision\t: {midr & 0xF}\n\n")
    return "".join(f"processor\t: {i}\n{block}" for i in range(cores))
