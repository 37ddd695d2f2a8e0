"""What the training loop reads back from the device, and when: the figures of a logging interval.

Why a module of its own: the loop must not wait for the device every micro-step (a host sync per
step costs throughput on CUDA), so a step's loss and gradient norm stay device tensors
(:class:`PendingSteps`) until an interval closes; :class:`Throughput` then turns the interval's
tokens, model FLOPs and wall time into tokens/s and MFU, for the whole run and for its steady part
(without the first step's compile and warm-up).
"""

from __future__ import annotations

import time

import torch

from train.distributed import DistContext
from train.flops import DevicePeak, ModelFlops, mfu


class Throughput:
    """Tokens, model FLOPs and wall time, counted per read-back interval, for the whole run and for its
    steady part (every interval after the one that closes the run's first step)."""

    def __init__(self, flops: ModelFlops | None, peak: DevicePeak, world: int):
        self.flops, self.peak, self.world = flops, peak, world
        self.tokens = self.time = self.model_flops = 0.0
        self.steady_tokens = self.steady_time = self.steady_flops = 0.0
        self._t0, self._by_len = time.perf_counter(), {}

    def count(self, seq_len: int, tokens: int) -> None:
        self._by_len[seq_len] = self._by_len.get(seq_len, 0) + tokens

    def restart(self) -> None:
        """Start the next interval now (time spent since, e.g. writing a checkpoint, is not training)."""
        self._t0 = time.perf_counter()

    def close(self, steady: bool) -> tuple[float, float | None]:
        """End the interval (after the device sync that read its losses back); its tokens/s and MFU."""
        seconds = time.perf_counter() - self._t0
        tokens = sum(self._by_len.values())
        flops = sum(n * self.flops.per_token(t) for t, n in self._by_len.items()) if self.flops else 0.0
        self.tokens += tokens
        self.time += seconds
        self.model_flops += flops
        if steady:
            self.steady_tokens += tokens
            self.steady_time += seconds
            self.steady_flops += flops
        self._by_len = {}
        self.restart()
        return tokens / seconds if seconds else 0.0, self._mfu(flops, seconds)

    def _mfu(self, flops: float, seconds: float) -> float | None:
        return mfu(flops, seconds, self.peak.tflops, self.world) if self.flops else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time if self.time else 0.0

    @property
    def steady_tokens_per_s(self) -> float | None:
        return self.steady_tokens / self.steady_time if self.steady_time else None

    @property
    def run_mfu(self) -> float | None:
        if self.steady_time:
            return self._mfu(self.steady_flops, self.steady_time)
        return self._mfu(self.model_flops, self.time)


class PendingSteps:
    """Steps whose loss and gradient norm still live on the device; :meth:`read` fetches them all
    with one copy (and, under FSDP, one all-reduce of the per-rank losses, each weighted by its
    share: ``DistContext.loss_weight``)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.rows: list[dict] = []
        self.values: list[torch.Tensor] = []

    def add(self, row: dict, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.rows.append(row)
        self.values.append(torch.stack([loss.float().reshape(()), grad_norm.float().reshape(()).to(loss.device)]))

    def read(self) -> list[dict]:
        if not self.rows:
            return []
        values = torch.stack(self.values)  # [steps, (loss, grad_norm)]
        if self.ctx.world > 1:
            import torch.distributed as dist

            losses = values[:, 0].to(self.ctx.device, torch.float64) * self.ctx.loss_weight
            dist.all_reduce(losses)
            values = torch.stack([losses, values[:, 1].to(self.ctx.device, torch.float64)], 1)
        host = values.tolist()  # the one device sync of the interval
        rows = self.rows
        for row, (loss, norm) in zip(rows, host):
            row["loss"], row["grad_norm"] = loss, norm
        self.rows, self.values = [], []
        return rows
