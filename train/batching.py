"""Dynamic batch sizing: halve the micro-batch on out-of-memory, keep the effective batch.

The effective per-rank batch (micro x accumulation) is fixed by the config, and the data
pipeline hands the loop one whole step's windows at once, so shrinking the micro-batch
changes neither which windows a step sees nor (up to float summation order) its gradient.
"""

from __future__ import annotations

import logging

import torch

from train.config import BatchConfig

log = logging.getLogger("optimize.train")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class MicroBatchPlan:
    def __init__(self, cfg: BatchConfig):
        self.effective = cfg.effective_per_rank
        self.micro = cfg.micro_batch_size
        self.min_micro = cfg.min_micro_batch_size
        self.shrinks = 0

    @property
    def accum(self) -> int:
        return -(-self.effective // self.micro)

    def shrink(self, exc: BaseException) -> None:
        """Halve the micro-batch after an OOM, or re-raise when it cannot get smaller."""
        new = self.micro // 2
        if new < self.min_micro:
            raise RuntimeError(
                f"out of memory at micro-batch {self.micro}; batch.min_micro_batch_size is {self.min_micro}"
            ) from exc
        log.warning("out of memory at micro-batch %d; retrying the step with %d", self.micro, new)
        self.micro = new
        self.shrinks += 1

    def state_dict(self) -> dict:
        return {"micro": self.micro, "effective": self.effective}

    def load_state_dict(self, state: dict) -> None:
        if state.get("effective") == self.effective:
            self.micro = int(state["micro"])
