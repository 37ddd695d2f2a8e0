"""The ARM64 environment the emulated checks run in: one command builds it, keyed and cached.

``optimize setup arm64`` (or ``make arm64``) needs nothing but Debian packages and PyPI wheels:

1. host tools from Debian: ``qemu-user-static`` (the emulator), ``mmdebstrap`` (the root) and
   ``gcc-aarch64-linux-gnu`` (the CUDA stubs); installed with apt when missing and run as root,
   else the one apt command is named;
2. an ARM64 Debian 12 root holding Python 3.11 and the C/C++ runtime libraries, extracted by
   mmdebstrap without running anything emulated (about 80 MB);
3. the pinned ARM64 wheels of the runtimes (torch, executorch, onnxruntime, onnxruntime-genai,
   numpy, ...) installed into it by the host's pip (``--platform manylinux_2_28_aarch64``), at the
   versions installed on the host, and without the CUDA wheels the ARM64 torch wheel asks for
   (:mod:`targets.arm64.cuda_stubs` stands in for them);
4. one small prefix per emulated core, whose ``/proc/cpuinfo`` and MIDR file describe that core
   (:mod:`targets.arm64.cpus`).

It lives in the user cache (``$OPTIMIZE_ARM64_HOME``, else ``<XDG cache>/edge-optimize-arm64``),
keyed by those versions, like pip's own cache: built once per version set (about a minute and
1.4 GB), and a build for other versions removes the older one. It is built in a temporary folder
and renamed into place, so a killed setup leaves nothing half-made.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from targets.arm64 import cpus
from targets.arm64.cuda_stubs import write_stubs

log = logging.getLogger("optimize")

#: bump when the layout below changes, so old environments are rebuilt
LAYOUT = 1
DEBIAN_SUITE = "bookworm"
#: Debian packages of the guest root (Python and the libraries the wheels link against)
ROOT_PACKAGES = ("python3.11", "libstdc++6", "libgcc-s1", "libgomp1", "libatomic1", "zlib1g")
#: Debian packages on the host: command -> package
HOST_TOOLS = {"qemu-aarch64-static": "qemu-user-static", "mmdebstrap": "mmdebstrap",
              "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu"}
#: wheels installed at the host's versions (distribution names); torch's CUDA wheels are left out
PINNED = ("torch", "executorch", "onnxruntime", "onnxruntime-genai", "numpy", "onnx", "protobuf", "ml_dtypes",
          "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
#: what ``import torch`` and ``executorch.runtime`` import (pure Python, any recent version)
UNPINNED = ("sympy", "mpmath", "filelock", "networkx", "jinja2", "markupsafe", "fsspec", "packaging",
            "flatbuffers", "pyyaml", "ruamel.yaml", "tabulate")
PLATFORMS = ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64")
#: parts of the torch wheel nothing at run time reads
PRUNE = ("torch/include", "torch/share/cmake", "torch/test")
MARKER = "environment.json"
#: the root's folders a guest sees in place of the host's (QEMU looks a path up under its -L
#: prefix first); every other path, the artifact's included, is the host's
PREFIX_DIRS = ("usr", "lib", "lib64", "bin", "sbin", "etc")


class Arm64SetupError(RuntimeError):
    """The ARM64 environment cannot be built here; the message says what to do."""


def home() -> Path:
    env = os.environ.get("OPTIMIZE_ARM64_HOME")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-optimize-arm64"


def pinned_versions() -> dict[str, str]:
    """The host's installed versions of :data:`PINNED`: the guest runs the same releases."""
    out = {}
    for dist in PINNED:
        try:
            # the ARM64 wheel of a local build (2.13.0+cpu) is the public release (2.13.0)
            out[dist] = metadata.version(dist).split("+")[0]
        except metadata.PackageNotFoundError:
            raise Arm64SetupError(f"{dist} is not installed on the host; the ARM64 environment installs the "
                                  "host's versions (run `make setup` first)") from None
    return out


def environment_key(versions: dict[str, str]) -> str:
    text = json.dumps({"layout": LAYOUT, "suite": DEBIAN_SUITE, "root": ROOT_PACKAGES, "versions": versions},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Arm64Environment:
    """A built environment: the guest root, the wheels' folder and the CUDA stubs."""

    path: Path

    @property
    def root(self) -> Path:
        return self.path / "root"

    @property
    def site(self) -> Path:
        return self.path / "site"

    @property
    def stubs(self) -> Path:
        return self.path / "stubs"

    def info(self) -> dict:
        return json.loads((self.path / MARKER).read_text())

    def prefix(self, cpu: cpus.EmulatedCpu) -> Path:
        """The QEMU ``-L`` prefix for ``cpu``: the root's folders plus that core's ``/proc/cpuinfo``
        and ``/sys`` identity (made on first use; tiny)."""
        p = self.path / "cpu" / cpu.name
        if (p / ".ready").is_file():
            return p
        tmp = Path(tempfile.mkdtemp(prefix=f".{cpu.name}-", dir=self.path))
        for name in PREFIX_DIRS:  # not tmp, home...: the guest reaches the host's files there
            if (self.root / name).exists() or (self.root / name).is_symlink():
                (tmp / name).symlink_to(self.root / name)
        (tmp / "proc").mkdir()
        (tmp / "proc/cpuinfo").write_text(cpus.cpuinfo_text(cpu))
        ident = tmp / "sys/devices/system/cpu/cpu0/regs/identification"
        ident.mkdir(parents=True)
        (ident / "midr_el1").write_text(f"0x{cpu.midr:016x}\n")
        for name in ("online", "possible", "present"):
            (tmp / "sys/devices/system/cpu" / name).write_text("0\n")
        (tmp / ".ready").write_text("")
        p.parent.mkdir(exist_ok=True)
        try:
            tmp.rename(p)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
        return p


def find() -> Arm64Environment | None:
    """The environment for the host's versions, if it is built."""
    try:
        key = environment_key(pinned_versions())
    except Arm64SetupError:
        return None
    env = Arm64Environment(home() / key)
    return env if (env.path / MARKER).is_file() else None


def require() -> Arm64Environment:
    """The built environment, or :class:`Arm64SetupError` saying what to run: the one check both
    the ARM64 check and ``optimize validate`` (``checks.arm64``) make."""
    env = find()
    if env is None:
        raise Arm64SetupError("the ARM64 environment is not set up for the installed versions; run "
                              "`optimize setup arm64` (or `make arm64`) once")
    if shutil.which("qemu-aarch64-static") is None:
        raise Arm64SetupError("qemu-aarch64-static is not installed; run `optimize setup arm64`")
    return env


def _host_tools(say) -> list[str]:
    """Install the missing Debian tools; returns the packages installed."""
    missing = sorted({pkg for cmd, pkg in HOST_TOOLS.items() if shutil.which(cmd) is None})
    if not missing:
        return []
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Arm64SetupError(f"the ARM64 check needs {', '.join(missing)} from Debian; install them with "
                              f"`sudo {' '.join(command[:2])} {' '.join(missing)}` and run this again")
    say(f"apt-get install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    if run.returncode != 0 and "Unable to locate package" in run.stderr:  # a machine whose package lists are empty
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env)
        run = subprocess.run(command, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise Arm64SetupError(f"apt-get install {' '.join(missing)} failed: {run.stderr.strip()[-400:]}")
    return missing


def _pip(target: Path, requirements: list[str], env: dict) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--implementation", "cp", "--target", str(target),
           *(a for p in PLATFORMS for a in ("--platform", p)), *requirements]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise Arm64SetupError(f"pip could not install the ARM64 wheels: {run.stderr.strip()[-600:]}")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def setup(*, force: bool = False, say=None) -> dict:
    """Build (or find) the ARM64 environment for the host's versions; returns what it holds.

    ``say`` receives one line per step (the CLI prints them; the API is quiet)."""
    say = say or (lambda _msg: None)
    versions = pinned_versions()
    key = environment_key(versions)
    dest = home() / key
    home().mkdir(parents=True, exist_ok=True)
    # one setup at a time (two test workers, two terminals): the second waits, then finds it built
    with open(home() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        installed = _host_tools(say)
        if (dest / MARKER).is_file() and not force:
            return {**json.loads((dest / MARKER).read_text()), "built": False, "host_packages_installed": installed}
        for entry in home().iterdir():  # what a killed setup left (no other setup runs now)
            if entry.name.startswith(".") and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
        info = _build(versions, key, dest, say)
    return {**info, "built": True, "host_packages_installed": installed}


def _build(versions: dict[str, str], key: str, dest: Path, say) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=home()))
    # pip unpacks about 1.8 GB of wheels before moving them into place: in the build folder, not /tmp
    scratch = work / ".tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    try:
        t0 = time.perf_counter()
        say(f"ARM64 Debian {DEBIAN_SUITE} root with {', '.join(ROOT_PACKAGES)} (mmdebstrap, nothing emulated)")
        run = subprocess.run(["mmdebstrap", "--quiet", "--mode=root", "--arch=arm64", "--variant=extract",
                              f"--include={','.join(ROOT_PACKAGES)}", DEBIAN_SUITE, str(work / "root")],
                             capture_output=True, text=True, env=env)
        if run.returncode != 0:
            raise Arm64SetupError(f"mmdebstrap failed (it needs deb.debian.org or a mirror): {run.stderr.strip()[-600:]}")
        t_root = time.perf_counter() - t0
        say("ARM64 wheels: " + ", ".join(f"{d}=={v}" for d, v in versions.items()))
        _pip(work / "site", [f"{d}=={v}" for d, v in versions.items()] + list(UNPINNED), env)
        shutil.rmtree(scratch, ignore_errors=True)
        for rel in PRUNE:
            shutil.rmtree(work / "site" / rel, ignore_errors=True)
        t_wheels = time.perf_counter() - t0 - t_root
        say("stand-ins for the CUDA libraries the ARM64 torch wheel links against")
        stubs = write_stubs(work / "site", work / "root", work / "stubs")
        info = {"key": key, "path": str(dest), "versions": versions, "debian": DEBIAN_SUITE,
                "root_packages": list(ROOT_PACKAGES), "cuda_stubs": stubs,
                "bytes": {"root": _size(work / "root"), "site": _size(work / "site")},
                "seconds": {"root": round(t_root, 1), "wheels": round(t_wheels, 1),
                            "total": round(time.perf_counter() - t0, 1)},
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (work / MARKER).write_text(json.dumps(info, indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    # other version sets' environments: nothing can use them again (bounded cache)
    for entry in home().iterdir():
        if entry != dest and (entry / MARKER).is_file():
            shutil.rmtree(entry, ignore_errors=True)
    return info
