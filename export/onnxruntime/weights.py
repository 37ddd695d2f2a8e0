"""Quantized weights as integers and scales, and their ONNX Runtime layouts.

:class:`BlockQuant` is one weight ``[N, K]`` (rows = output features) as the integers and
block scales a quantization stage chose. It is read straight from torchao's
``IntxUnpackedToInt8Tensor`` (``qdata`` / ``scale`` / ``zero_point``), so GPTQ's, AWQ's or
HQQ's choices reach the graph exactly -- nothing here rounds a float weight again, except
:func:`rtn_int8_rows`, the exporter's own per-channel int8 for an fp32 model.

Layouts (checked against ORT 1.31 on this machine): ``MatMulNBits`` and
``GatherBlockQuantized`` store unsigned values ``q + 2**(bits-1)`` (the default zero point),
two 4-bit values per byte low nibble first, row-major per output row ``[N, blocks, block*bits/8]``.
Their block size must be a power of two >= 16, so a per-channel scale (group = K) is written as
a block size that divides it with the scale repeated per block: the same numbers, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: block sizes MLAS's n-bit kernels take, largest first
NBITS_BLOCKS = (256, 128, 64, 32, 16)


@dataclass
class BlockQuant:
    """Integers ``q`` [N, K] (int8 storage), scales [N, K // group] and optional zero points
    (same shape, in the integer domain): ``w = (q - zero) * scale`` per group of ``group`` columns."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group: int
    #: where the numbers came from ("torchao 8da4w", "rtn int8", ...), for the manifest
    source: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.q.to(torch.float32).reshape(n, k // self.group, self.group)
        if self.zero is not None:
            q = q - self.zero.to(torch.float32)[..., None]
        return (q * self.scale.to(torch.float32)[..., None]).reshape(n, k)

    def rows(self, start: int, stop: int) -> "BlockQuant":
        zero = None if self.zero is None else self.zero[start:stop]
        return BlockQuant(self.q[start:stop], self.scale[start:stop], zero, self.bits, self.group, self.source)

    def same_layout(self, other: "BlockQuant") -> bool:
        return (self.bits, self.group, self.shape[1], self.zero is None) == (other.bits, other.group, other.shape[1], other.zero is None)


def cat_rows(parts: list[BlockQuant]) -> BlockQuant:
    """Stack weights along the output dimension (a packed QKV projection)."""
    first = parts[0]
    if not all(first.same_layout(p) for p in parts[1:]):
        raise ValueError("cannot pack weights with different bits, group size or zero points into one MatMul")
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return BlockQuant(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero, first.bits,
                      first.group, first.source)


_BITS = {torch.int4: 4, torch.int8: 8}


def from_torchao(weight: torch.Tensor) -> BlockQuant | None:
    """The integers and scales of a torchao ``IntxUnpackedToInt8Tensor`` weight, or None for a
    plain tensor. Other quantized tensor types are an error (their numbers are not read here)."""
    name = type(weight).__name__
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return None
    if name != "IntxUnpackedToInt8Tensor":
        raise ValueError(f"{name} weights have no ONNX Runtime layout here (only torchao IntxUnpackedToInt8Tensor)")
    bits = _BITS.get(weight.target_dtype)
    if bits is None:
        raise ValueError(f"{weight.target_dtype} weights have no ONNX Runtime kernel (MatMulNBits takes 4 or 8 bits)")
    block = tuple(int(b) for b in weight.block_size)
    if len(block) != 2 or block[0] != 1:
        raise ValueError(f"weight block size {block} is not row-wise groups (1, group)")
    zero = weight.zero_point
    if zero.dtype.is_floating_point:
        raise ValueError("float zero points (HQQ with zero points) have no exact integer layout in ONNX Runtime")
    zero = None if not bool(zero.any()) else zero.to(torch.int32)
    return BlockQuant(weight.qdata.detach().clone(), weight.scale.detach().to(torch.float32).clone(), zero, bits,
                      block[1], f"torchao int{bits}")


def rtn_int8_rows(w: torch.Tensor) -> BlockQuant:
    """Symmetric int8 with one scale per output row (``max|w_row| / 127``): the exporter's own
    W8A8 weights (what ``quantize: dynamic_per_token`` always used)."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
    return BlockQuant(q, scale, None, 8, int(w.shape[1]), "rtn int8 per channel")


def nbits_block(bq: BlockQuant, max_block: int | None = None) -> int:
    """A block size MLAS takes that tiles every group exactly (the scale repeats per block), at most
    ``max_block`` columns where given."""
    for b in NBITS_BLOCKS:
        if bq.group % b == 0 and (max_block is None or b <= max_block):
            return b
    raise ValueError(f"group size {bq.group} is not a multiple of 16; MatMulNBits/GatherBlockQuantized need "
                     "power-of-two blocks of at least 16 columns")


def nbits_arrays(bq: BlockQuant, max_block: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """(packed weights [N, blocks, block*bits/8] uint8, scales [N, blocks] float32, zero points
    (packed uint8) or None, block size) for ``MatMulNBits`` / ``GatherBlockQuantized``; blocks of at
    most ``max_block`` columns where given."""
    n, k = bq.shape
    block = nbits_block(bq, max_block)
    reps = bq.group // block
    off = 1 << (bq.bits - 1)
    lo, hi = -off, off - 1
    q = bq.q.to(torch.int32)
    if int(q.min()) < lo or int(q.max()) > hi:
        raise ValueError(f"integers outside the {bq.bits}-bit range [{lo}, {hi}]")
    u = (q + off).to(torch.uint8).numpy().reshape(n, k // block, block)
    if bq.bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)
    scales = bq.scale.to(torch.float32).repeat_interleave(reps, dim=1).numpy()
    zp = None
    if bq.zero is not None:
        z = (bq.zero.to(torch.int32).repeat_interleave(reps, dim=1) + off).to(torch.uint8).numpy()
        if bq.bits == 4:
            if z.shape[1] % 2:
                z = np.concatenate([z, np.full((n, 1), off, np.uint8)], axis=1)
            z = z[:, 0::2] | (z[:, 1::2] << 4)
        zp = np.ascontiguousarray(z)
    return np.ascontiguousarray(u, dtype=np.uint8), np.ascontiguousarray(scales, dtype=np.float32), zp, block


def int8_columns(bq: BlockQuant) -> tuple[np.ndarray, np.ndarray]:
    """(int8 weights [K, N], one float32 scale per column) for ``MatMulInteger`` with a
    per-output-channel symmetric weight; other layouts have no such form."""
    if bq.bits != 8 or bq.group != bq.shape[1] or bq.zero is not None:
        raise ValueError("MatMulInteger needs symmetric int8 weights with one scale per output channel")
    return (np.ascontiguousarray(bq.q.to(torch.int8).numpy().T),
            np.ascontiguousarray(bq.scale[:, 0].to(torch.float32).numpy()))
