"""This process's resident memory from the kernel: the current figure, the peak, and resetting the peak.

One reader for the three places that measure memory: a pipeline row's cost
(:mod:`optimize.resources`), an exported artifact's footprint in a child process
(:mod:`optimize.footprint.memory`) and a training phase's peak (:mod:`train.memory`). On Linux the figures
are ``/proc/self/status``'s ``VmRSS`` (now) and ``VmHWM`` (the high-water mark), and the mark is
reset to the current figure by writing 5 to ``/proc/self/clear_refs``, so each span's short
spikes count; elsewhere both calls say they could not (None, False) and the callers fall back.
"""

from __future__ import annotations


def status_bytes(key: str) -> int | None:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``...); None where there is none."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the peak (``VmHWM``) to the current resident set; False where the kernel does not allow
    it, or ignored it (the peak still above the current figure by more than a MiB afterwards)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    hwm, rss = status_bytes("VmHWM"), status_bytes("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 2**20
