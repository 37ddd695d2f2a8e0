"""Run artifacts in the ARM64 builds of their runtimes, under QEMU user-mode emulation.

:mod:`~targets.arm64.environment` builds the ARM64 root and wheels (``optimize setup arm64``),
:mod:`~targets.arm64.cpus` picks the emulated core a device profile stands for,
:mod:`~targets.arm64.cuda_stubs` lets the ARM64 torch wheel load without NVIDIA's libraries, and
:mod:`~targets.arm64.emulate` runs a guest Python. :mod:`export.arm64` uses them to verify an
artifact. Importing this package imports nothing heavy.
"""
