"""The ISA feature names device profiles and target profiles share.

A device profile lists the features its cores have (:mod:`targets.devices`); a target profile
lists the features its shipped runtime build needs on arm64 (:mod:`targets.profile`), so that
``optimize validate`` can refuse a device whose cores lack one before anything is exported.
"""

from __future__ import annotations

from typing import Literal

#: ISA features a profile may name (arm64 HWCAP names, x86 /proc/cpuinfo flags)
ISA_FEATURES: dict[str, str] = {
    "neon": "arm64 Advanced SIMD",
    "lse": "arm64 Large System Extensions, the ARMv8.1 atomic instructions (HWCAP atomics)",
    "fp16": "arm64 half-precision arithmetic (asimdhp)",
    "dotprod": "arm64 int8 dot product (SDOT/UDOT, asimddp): XNNPACK's int8 GEMM kernels",
    "i8mm": "arm64 int8 matrix multiply (SMMLA): XNNPACK's faster int8/int4 GEMM kernels",
    "bf16": "arm64 bfloat16 dot product / matrix multiply",
    "sve": "arm64 Scalable Vector Extension",
    "sve2": "arm64 SVE2",
    "sme": "arm64 Scalable Matrix Extension",
    "fma": "x86 fused multiply-add",
    "avx2": "x86 AVX2",
    "avx512f": "x86 AVX-512 foundation",
    "avx512_vnni": "x86 AVX-512 VNNI (int8 dot product)",
    "avx_vnni": "x86 AVX-VNNI (int8 dot product on 256-bit)",
    "avx512_bf16": "x86 AVX-512 bfloat16",
    "amx_int8": "x86 AMX int8 tiles",
}
IsaFeature = Literal[tuple(ISA_FEATURES)]  # type: ignore[valid-type]

#: ISA features only x86 has: a profile naming one is an x86 CPU
X86_FEATURES = ("fma", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def arch_of(isa) -> str:
    """The instruction set of a feature list that names none: x86_64 where it has an x86-only
    feature, else aarch64."""
    return "x86_64" if set(isa) & set(X86_FEATURES) else "aarch64"
