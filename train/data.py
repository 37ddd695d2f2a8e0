"""Packed token windows through a DataLoader whose position can be saved and restored exactly.

The sampler, not the loader, owns the position: it counts windows the *loop* has consumed,
so prefetching workers never make a resumed run skip or repeat data. One loader batch is
one optimizer step's worth of windows for this rank; the loop cuts it into micro-batches,
so halving the micro-batch on OOM does not change which windows a step sees.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class PackedWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` ids from a 1-D id tensor (inputs + shifted labels).

    Windows are views of the one token stream (window ``i`` starts at ``i * seq_len``), so
    re-windowing the same stream at another length (a length curriculum) copies nothing and
    wastes no token on padding: only the stream's last ``< seq_len`` tokens go unused.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int):
        ids = torch.as_tensor(ids, dtype=torch.long)
        self.seq_len = seq_len
        if ids.dim() == 2:  # already windowed by the caller
            self.windows, self.stream, self.n = ids, None, ids.shape[0]
            self.seq_len = ids.shape[1] - 1
        else:
            self.windows, self.stream = None, ids.reshape(-1)
            self.n = (ids.numel() - 1) // seq_len
            if self.n < 1:
                raise ValueError(f"{ids.numel()} tokens are too few for one window of {seq_len} + 1")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.windows is not None:
            return self.windows[i]
        if not -self.n <= i < self.n:
            raise IndexError(f"window {i} of {self.n}")
        i %= self.n
        return self.stream[i * self.seq_len : i * self.seq_len + self.seq_len + 1]


class ResumableBatchSampler(Sampler[list[int]]):
    """Yields this rank's step batches from a seeded per-epoch permutation, from a saved position.

    ``position`` counts step batches already consumed (across epochs); every rank holds the
    same value, and rank ``r`` takes windows ``r, r + world, ...`` of each global step batch.
    """

    def __init__(self, n: int, per_rank_batch: int, rank: int = 0, world: int = 1, seed: int = 0):
        self.n, self.per_rank, self.rank, self.world, self.seed = n, per_rank_batch, rank, world, seed
        self.global_batch = per_rank_batch * world
        if n < self.global_batch:
            raise ValueError(f"{n} windows are fewer than one global batch of {self.global_batch}")
        self.steps_per_epoch = n // self.global_batch
        self.position = 0

    def _batch(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.n, generator=g)
        chunk = perm[k * self.global_batch : (k + 1) * self.global_batch]
        return chunk[self.rank :: self.world].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        step = self.position
        while True:  # endless: the loop decides when to stop
            yield self._batch(step)
            step += 1

    def __len__(self) -> int:  # one epoch, for progress display only
        return self.steps_per_epoch

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "n": self.n, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n") != self.n or state.get("global_batch") != self.global_batch:
            raise ValueError(
                f"checkpoint data position is for {state.get('n')} windows in batches of {state.get('global_batch')};"
                f" this run has {self.n} in batches of {self.global_batch} (same data and batch settings needed)"
            )
        self.seed = int(state["seed"])
        self.position = int(state["position"])


def _collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    w = torch.stack(rows)
    return {"input_ids": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous()}


def make_loader(
    dataset: Dataset,
    sampler: ResumableBatchSampler,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """A DataLoader over step batches; build a new one after changing ``sampler.position``."""
    kwargs = {}
    if num_workers > 0:
        kwargs = dict(prefetch_factor=prefetch_factor or 2, persistent_workers=False)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        collate_fn=_collate,
        # its own generator: building the loader must not consume the global RNG, or a
        # resumed run's dropout stream would differ from an uninterrupted run's
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )


def split_micro(batch: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + micro] for k, v in batch.items()} for i in range(0, n, micro)]
