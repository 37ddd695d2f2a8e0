"""Which integer GEMM ONNX Runtime runs for our int8 weights: u8s8 or u8u8.

Every int8 Linear we export multiplies *uint8* activations by 8-bit weights (``MatMulInteger``,
``DynamicQuantizeMatMul``, ORT's own dynamic and QDQ quantizers). With *int8* weights (u8s8), ORT's
x86 kernels without VNNI (AVX2, and AVX-512 before VNNI) use ``vpmaddubsw``, which adds two
u8 x s8 products into a *saturating* 16-bit lane: 255 x 127 x 2 = 64770 does not fit in 32767,
so real activations come out wrong, not approximately right. Measured on a 2-core AMD EPYC with
AVX2 and no VNNI (onnxruntime 1.31): a 128x256x512 ``MatMulInteger`` on full-range values was
wrong in 99% of its outputs (max error 86682); a tiny Llama exported with ``quantize: dynamic``
agreed with fp32 on 40% of top-1 tokens (u8u8: 85%). ORT documents this and suggests ``reduce_range``
(7-bit weights, one bit of precision lost) or u8u8.

u8u8 stores the *same* integers shifted by 128 (``uint8 = int8 + 128``, weight zero point 128):
the integer products are identical, nothing saturates on any CPU, and it costs some speed where
u8s8 is fast (the 128x256x512 GEMM above: 0.59 ms u8u8 against 0.44 ms of wrong u8s8). VNNI
(``vpdpbusd``) and arm64's dot products do not saturate, so u8s8 is right there.

``int8_format: auto`` picks u8u8 on an x86 CPU without VNNI and u8s8 elsewhere. The CPU it asks is
the pipeline's device profile's (its ``isa`` list), where the run names one other than ``host``,
else this host's, where the artifact is verified. An artifact shipped to another x86 CPU should
say u8u8 unless that CPU has VNNI; the runner warns when it loads u8s8 on a CPU that saturates it.
"""

from __future__ import annotations

import platform
import warnings
from typing import Iterable, Literal

import numpy as np

from targets.devices import host_isa

Int8Format = Literal["auto", "u8s8", "u8u8"]

#: ISA features (``targets.devices.ISA_FEATURES`` names) whose u8 x s8 dot products do not saturate
VNNI_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8")
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")
#: the weight zero point that makes uint8 storage hold the int8 grid exactly
U8_ZERO_POINT = 128


def u8u8_arrays(w_q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 weights ``w_q + 128``, one uint8 zero point of 128 per output column) for int8
    weights ``w_q`` [K, N]: ``B - b_zero_point`` is ``w_q`` exactly."""
    return ((w_q.astype(np.int16) + U8_ZERO_POINT).astype(np.uint8),
            np.full(w_q.shape[1], U8_ZERO_POINT, np.uint8))


def u8s8_saturates(isa: Iterable[str], machine: str) -> bool:
    """True where ORT's u8 x s8 GEMM adds pairs in saturating 16-bit lanes (x86 without VNNI)."""
    return machine.lower() in _X86 and not set(isa) & set(VNNI_FEATURES)


def host_u8s8_saturates() -> bool:
    return u8s8_saturates(host_isa(), platform.machine())


def resolve_int8_format(option: str, isa: Iterable[str] | None = None, machine: str | None = None,
                        where: str | None = None) -> dict:
    """``{"format": "u8s8"|"u8u8", "why": ...}`` for the option; ``auto`` asks ``isa``/``machine``
    (a device profile's; ``where`` names it) or, when they are None, this host's CPU."""
    if option in ("u8s8", "u8u8"):
        return {"format": option, "why": "set by int8_format"}
    if option != "auto":
        raise ValueError(f"int8_format must be 'auto', 'u8s8' or 'u8u8', got {option!r}")
    where = where or ("the device profile's CPU" if isa is not None else "this host's CPU")
    if isa is None:
        isa = host_isa()
    machine = machine or platform.machine()
    isa = sorted(isa)
    if u8s8_saturates(isa, machine):
        return {"format": "u8u8", "why": f"auto: {where} ({machine}, no VNNI) saturates u8 x s8 int8 GEMMs"}
    vnni = [f for f in isa if f in VNNI_FEATURES]
    return {"format": "u8s8", "why": f"auto: {where} ({machine}{', ' + ', '.join(vnni) if vnni else ''}) "
                                     "runs u8 x s8 without saturation"}


def warn_if_saturates(fmt: str | None, artifact: str) -> bool:
    """Warn (once per call) when a u8s8 artifact is loaded on a CPU that saturates it; True if it did."""
    if fmt != "u8s8" or not host_u8s8_saturates():
        return False
    warnings.warn(f"{artifact}: int8 weights are u8s8, which ONNX Runtime computes with saturating 16-bit sums on "
                  "this CPU (x86 without VNNI); its outputs will be wrong. Re-export with int8_format: u8u8 "
                  "(or auto on this machine).", RuntimeWarning, stacklevel=3)
    return True
