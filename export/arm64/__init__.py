"""Verify an exported artifact in the ARM64 build of its runtime (:mod:`export.arm64.verify`), by
running the same probe (:mod:`export.arm64.probe`) on the host and on an emulated Arm core."""
