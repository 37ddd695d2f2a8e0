"""Run Python in the ARM64 environment on an emulated core (QEMU user mode).

The guest sees only the environment's root, wheels and CUDA stubs, plus the folders passed as
``paths`` (this project's ``export`` and ``targets`` packages, the artifact): its Python path is
exactly those, and its environment is cleared but for the thread settings. A guest that dies of a
signal (``SIGILL``: an instruction the emulated core lacks) is reported as such, with the core.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from targets.arm64.cpus import EmulatedCpu
from targets.arm64.environment import Arm64Environment

#: what a guest keeps of the host's environment
KEEP_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class GuestResult:
    returncode: int
    stdout: str
    stderr: str
    cpu: EmulatedCpu

    @property
    def signal(self) -> str | None:
        """The signal that ended the guest (QEMU exits with 128 + signal, or is killed by it)."""
        code = -self.returncode if self.returncode < 0 else self.returncode - 128 if self.returncode > 128 else 0
        try:
            return signal.Signals(code).name if code else None
        except ValueError:
            return None

    def failure(self) -> str | None:
        """One line saying why the guest failed, or None."""
        if self.returncode == 0:
            return None
        sig = self.signal
        if sig == "SIGILL":
            return (f"the runtime executed an instruction {self.cpu.name} ({self.cpu.arch_level}) does not have "
                    "(SIGILL): this build cannot run on that core")
        tail = [ln for ln in self.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit status {self.returncode}"]
        return f"the guest failed{f' ({sig})' if sig else ''}: {tail[0][-300:]}"


def run_python(env: Arm64Environment, cpu: EmulatedCpu, args: list[str], *, paths: list[Path],
               timeout: float = 1800, threads: int = 2) -> GuestResult:
    """``python3.11 ARGS`` on ``cpu``, with ``paths`` first on the guest's Python path."""
    prefix = env.prefix(cpu)
    guest_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([*map(str, paths), str(env.site)]),
                 "LD_LIBRARY_PATH": str(env.stubs), "PYTHONUNBUFFERED": "1",
                 "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": "1", "HOME": "/tmp"}
    cmd = ["qemu-aarch64-static", "-cpu", cpu.qemu, "-L", str(prefix), str(prefix / "usr/bin/python3.11"), *args]
    try:
        run = subprocess.run(cmd, env=guest_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return GuestResult(124, exc.stdout or "", f"timed out after {timeout:.0f} s", cpu)
    return GuestResult(run.returncode, run.stdout, run.stderr, cpu)
