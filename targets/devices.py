"""Device profiles: the phone or board a model must fit, as data.

A target profile (:mod:`targets.profile`) says which runtime an artifact is for; a device profile
says what one machine running that runtime offers: total RAM and the memory an app can really
use, the storage allowed for the model, memory bandwidth (theoretical and the fraction a large copy
reaches), big/mid/little cores, ISA features, which targets run there, and budgets. With
``device_profile:`` in a pipeline YAML (or ``--device-profile``), every export row is checked
against it: measured peak memory against the usable memory, the artifact against the storage
budget, and a predicted decode rate against the decode budget (:mod:`optimize.footprint.predict`).

Profiles live in ``targets/devices/*.yaml``, each figure with a YAML comment naming its source (or
saying it is an estimate); a user can point at a file of their own. The ``host`` profile is not
written down but measured when loaded (:func:`measure_host`): RAM from ``/proc/meminfo``, cores and
ISA flags from ``/proc/cpuinfo``, bandwidth from a timed large tensor copy.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from targets.config_base import Strict
from targets.isa import ISA_FEATURES, IsaFeature, arch_of
from targets.profile import TargetProfile, target_names

DEVICE_DIR = Path(__file__).parent / "devices"
GIB = 2**30



class DeviceError(ValueError):
    """A device profile is unknown or malformed, or a pipeline does not suit it."""


class DeviceMemory(Strict):
    total_gib: float = Field(gt=0, description="installed RAM, GiB")
    usable_gib: float = Field(gt=0, description="memory one app (one process) can really use, GiB")
    usable_basis: str = Field(description="the assumption behind usable_gib, in words")

    @model_validator(mode="after")
    def _usable_below_total(self):
        if self.usable_gib > self.total_gib:
            raise ValueError(f"usable_gib {self.usable_gib} exceeds total_gib {self.total_gib}")
        return self


class Bandwidth(Strict):
    theoretical_gb_s: float = Field(gt=0, description="DRAM bandwidth from the bus width and data rate, GB/s (1e9)")
    practical_fraction: float = Field(
        gt=0, le=1, description="fraction of theoretical_gb_s a large tensor copy (read+write) reaches: the "
        "same quantity the host's measured copy bandwidth is")

    @property
    def practical_gb_s(self) -> float:
        return self.theoretical_gb_s * self.practical_fraction


class Cores(Strict):
    big: int = Field(ge=1, description="performance cores (prime and big)")
    mid: int = Field(0, ge=0, description="middle cores where the SoC has three tiers")
    little: int = Field(0, ge=0, description="efficiency cores")

    @property
    def total(self) -> int:
        return self.big + self.mid + self.little


class CoreModels(Strict):
    """Each tier's core as GCC's ``-mcpu`` and QEMU's ``-cpu`` name it (``cortex-a76``), where known."""

    big: str
    mid: str | None = None
    little: str | None = None


class DeviceBudgets(Strict):
    """Limits beyond what the device physically has; ``None`` means no limit."""

    decode_tok_s: float | None = Field(None, gt=0, description="slowest acceptable predicted decode, tokens/s")


class DeviceProfile(Strict):
    name: str
    description: str
    kind: Literal["phone", "board", "host"]
    soc: str = Field(description="system on chip / CPU model")
    cpu: str = Field(description="the CPU cores in words (model and clock per tier)")
    memory: DeviceMemory
    storage_gib: float = Field(gt=0, description="storage the model's files may take on the device, GiB")
    bandwidth: Bandwidth
    cores: Cores
    isa: list[IsaFeature] = Field(description="ISA features the runtimes' kernels can use")  # type: ignore[valid-type]
    arch: Literal["aarch64", "x86_64"] | None = Field(
        None, description="instruction set; left out: x86_64 where isa names an x86-only feature, else aarch64")
    arch_level: str | None = Field(
        None, description="the oldest architecture version among the cores (armv8-a, armv8.2-a, ...): the "
        "ISA floor every runtime build must fit; the features it implies are listed in isa")
    core_models: CoreModels | None = Field(
        None, description="each tier's core as GCC/QEMU name it (cortex-a76), where known")
    runtimes: dict[str, str] = Field(description="target profile name -> the runtime and backend on this device")
    budgets: DeviceBudgets = Field(default_factory=DeviceBudgets)
    measured: dict[str, str] | None = Field(
        None, description="host only: how each figure was measured on this machine, and when")

    @model_validator(mode="after")
    def _arch_from_isa(self):
        if self.arch is None:
            self.arch = arch_of(self.isa)
        return self

    @field_validator("runtimes")
    @classmethod
    def _known_targets(cls, runtimes: dict[str, str]) -> dict[str, str]:
        unknown = [k for k in runtimes if k not in target_names()]
        if unknown:
            raise ValueError(f"unknown target {', '.join(map(repr, unknown))}; targets: {', '.join(target_names())}")
        return runtimes

    @property
    def usable_bytes(self) -> int:
        return int(self.memory.usable_gib * GIB)

    @property
    def storage_bytes(self) -> int:
        return int(self.storage_gib * GIB)

    def check_target(self, target: str) -> str | None:
        """None if the target's runtime runs on this device, else a sentence saying why not."""
        if target in self.runtimes:
            return None
        return (f"device {self.name!r} does not run target {target!r}; it runs: {', '.join(self.runtimes)}")

    def check_isa(self, target: TargetProfile) -> str | None:
        """None if this device's cores have every feature the target's arm64 runtime build needs,
        else one sentence naming the device's cores, the missing feature and what needs it."""
        if self.arch != "aarch64":
            return None
        missing = [f for f in target.requires_isa_aarch64 if f not in self.isa]
        if not missing:
            return None
        cores = self.cpu + (f", {self.arch_level}" if self.arch_level else "")
        needs = "; ".join(f"{f} ({ISA_FEATURES[f]}): {target.requires_isa_aarch64[f]}" for f in missing)
        return f"device {self.name!r} ({cores}) cannot run target {target.name!r}: its cores lack {needs}"

    def summary(self) -> str:
        cores = "+".join(str(n) for n in (self.cores.big, self.cores.mid, self.cores.little) if n)
        return (f"RAM {self.memory.total_gib:g} GiB (usable {self.memory.usable_gib:g}), "
                f"bandwidth {self.bandwidth.theoretical_gb_s:g} GB/s x {self.bandwidth.practical_fraction:g} = "
                f"{self.bandwidth.practical_gb_s:.1f} GB/s, cores {cores}, {','.join(self.isa)}")


# ---- loading --------------------------------------------------------------------------------


def device_names() -> list[str]:
    return sorted(p.stem for p in DEVICE_DIR.glob("*.yaml"))


def list_devices() -> list[DeviceProfile]:
    return [load_device(p) for p in sorted(DEVICE_DIR.glob("*.yaml"))]


def device_path(name_or_path: str | Path) -> Path:
    """The YAML a name or path refers to; :class:`DeviceError` listing the shipped names if none."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if path.is_file():
            return path
        raise DeviceError(f"device profile file not found: {path}")
    path = DEVICE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise DeviceError(f"unknown device profile {str(name_or_path)!r}; available: {', '.join(device_names())} "
                          f"(in {DEVICE_DIR}), or a path to a profile YAML")
    return path


def load_device(name_or_path: str | Path) -> DeviceProfile:
    """Load a shipped profile by name (``pixel-8``) or a profile YAML by path. A profile with
    ``measure: host`` takes its figures from this machine (:func:`measure_host`)."""
    path = device_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DeviceError(f"device profile {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise DeviceError(f"device profile {path}: the top level must be a mapping of keys")
    if data.get("measure") == "host":
        data = {**measure_host(), **{k: v for k, v in data.items() if k != "measure"}}
    try:
        return DeviceProfile.model_validate(data)
    except ValidationError as exc:
        lines = []
        for e in exc.errors(include_url=False):
            loc = [str(p) for p in e["loc"]] + ([e["ctx"]["unknown"]] if e["type"] == "unknown_key" else [])
            lines.append(f"  {'.'.join(loc) or '<root>'}: {e['msg']}")
        raise DeviceError(f"device profile {path} is invalid:\n" + "\n".join(lines)) from None


# ---- the host, measured ---------------------------------------------------------------------


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is none)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, feature flags) from /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "Hardware") and value.strip():
                model = value.strip()
            elif key in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:
        pass
    return model, flags


#: /proc/cpuinfo flag -> profile ISA name
_FLAG_NAMES = {"asimd": "neon", "atomics": "lse", "asimdhp": "fp16", "asimddp": "dotprod", "i8mm": "i8mm", "bf16": "bf16",
               "sve": "sve", "sve2": "sve2", "sme": "sme", "fma": "fma", "avx2": "avx2", "avx512f": "avx512f",
               "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni", "avx512_bf16": "avx512_bf16",
               "amx_int8": "amx_int8"}


def host_isa() -> list[str]:
    """This machine's ISA features under the profile names (``ISA_FEATURES``), from /proc/cpuinfo."""
    return sorted({_FLAG_NAMES[f] for f in _cpuinfo()[1] if f in _FLAG_NAMES})


def _core_tiers(cpus: list[int]) -> dict[str, int]:
    """Big/mid/little from the kernel's per-core capacity (arm64 big.LITTLE); all big elsewhere."""
    caps = []
    for c in cpus:
        try:
            caps.append(int(Path(f"/sys/devices/system/cpu/cpu{c}/cpu_capacity").read_text()))
        except (OSError, ValueError):
            return {"big": len(cpus), "mid": 0, "little": 0}
    levels = sorted(set(caps), reverse=True)
    if len(levels) == 1:
        return {"big": len(cpus), "mid": 0, "little": 0}
    big = sum(c == levels[0] for c in caps)
    little = sum(c == levels[-1] for c in caps)
    return {"big": big, "mid": len(caps) - big - little, "little": little}


def copy_bandwidth(nbytes: int = 256 << 20, runs: int = 5) -> float:
    """Read+write traffic of a large float32 tensor copy with torch's current threads, bytes/s
    (median of ``runs`` after one untimed copy): the same measure as ``bench/executorch.py``."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


@functools.lru_cache(maxsize=4)
def _host_bandwidth(threads: int) -> tuple[float, list[float]]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        samples = sorted(copy_bandwidth(runs=3) for _ in range(3))
    finally:
        torch.set_num_threads(old)
    return statistics.median(samples), samples


def host_bandwidth(threads: int | None = None) -> float:
    """This machine's copy bandwidth in bytes/s with ``threads`` torch threads (default: torch's
    current count); measured once per process and thread count."""
    import torch

    return _host_bandwidth(int(threads or torch.get_num_threads()))[0]


def measure_host(threads: int | None = None) -> dict:
    """A device-profile dict for this machine: total RAM and MemAvailable (/proc/meminfo), cores and
    ISA flags (/proc/cpuinfo, /sys), free disk space where runs are written, and the copy bandwidth
    (median of three medians of 256 MiB copies). ``practical_fraction`` is 1: the measured figure is
    already practical."""
    import torch

    mem = _meminfo()
    total = mem.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    avail = mem.get("MemAvailable", total)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    model, _ = _cpuinfo()
    isa = host_isa()
    n = int(threads or torch.get_num_threads())
    bw, samples = _host_bandwidth(n)
    free = shutil.disk_usage(Path.cwd()).free
    return {
        "name": "host",
        "description": f"this machine ({platform.machine()}, {model}), measured when loaded",
        "kind": "host",
        "soc": model,
        "cpu": f"{len(cpus)} cores available to this process ({os.cpu_count()} online)",
        "memory": {"total_gib": round(total / GIB, 2), "usable_gib": round(min(avail, total) / GIB, 2),
                   "usable_basis": "MemAvailable from /proc/meminfo when the profile was loaded"},
        "storage_gib": round(free / GIB, 1),
        "bandwidth": {"theoretical_gb_s": round(bw / 1e9, 2), "practical_fraction": 1.0},
        "cores": _core_tiers(cpus),
        "isa": isa,
        "arch": {"arm64": "aarch64"}.get(platform.machine(), platform.machine())
        if platform.machine() in ("x86_64", "aarch64", "arm64") else None,
        "runtimes": {t: "as installed here" for t in target_names()},
        "measured": {
            "memory": "/proc/meminfo MemTotal and MemAvailable",
            "cores": "sched_getaffinity; tiers from /sys/devices/system/cpu/cpu*/cpu_capacity where present",
            "isa": "/proc/cpuinfo flags/Features",
            "storage": f"free space on the file system of {Path.cwd()}",
            "bandwidth": (f"read+write of a 256 MiB float32 tensor copy with {n} torch thread(s), median of 3 "
                          f"medians of 3: {', '.join(f'{s / 1e9:.1f}' for s in samples)} GB/s; the figure is "
                          "practical already (practical_fraction 1)"),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
