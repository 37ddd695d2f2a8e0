"""Parameter count and serialized size of an eager model.

Size is measured by serializing the state dict (quantized tensor subclasses serialize
packed), so it is what a checkpoint of this stage really costs on disk.
"""

from __future__ import annotations

import io

import torch


def parameter_count(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


class _CountingWriter(io.RawIOBase):
    def __init__(self):
        self.n = 0

    def writable(self):
        return True

    def write(self, b):
        self.n += len(b)
        return len(b)


def serialized_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``torch.save(state_dict)`` without writing a file (tied weights counted once)."""
    sink = _CountingWriter()
    with io.BufferedWriter(sink) as buf:
        torch.save(model.state_dict(), buf)
    return sink.n
