"""Sequence-length curriculum: short windows first, the full length last, resumable mid-way.

Each stage re-windows the same packed token stream at its own length (views, no copy, no
padding), and has its own seeded, resumable sampler, so a step's windows depend only on
(stage, position in the stage), never on how the run got there. The checkpoint records
the stage, its length and the sampler position; a resumed run checks them against its own
schedule, so a changed curriculum is refused instead of silently training other data.
Without a curriculum there is one stage at the full length (the plain loop's behaviour).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from train.config import CurriculumStage
from train.data import PackedWindows, ResumableBatchSampler, make_loader

log = logging.getLogger("optimize.train")


@dataclass(frozen=True)
class Stage:
    index: int
    first_step: int  # optimizer steps done before this stage starts
    last_step: int | None  # the stage's last step (inclusive); None for the final stage
    seq_len: int


class LengthSchedule:
    """``steps -> seq_len``: the configured stages, then ``final_seq_len`` until the run ends."""

    def __init__(self, stages: Sequence[CurriculumStage], final_seq_len: int):
        out, first = [], 0
        for i, st in enumerate(stages):
            if st.seq_len >= final_seq_len:
                raise ValueError(
                    f"curriculum stage {i} has seq_len {st.seq_len}; stages must be shorter than the full "
                    f"length {final_seq_len} the run ends with"
                )
            if st.until_step <= first or (out and st.seq_len <= out[-1].seq_len):
                raise ValueError("curriculum stages must grow: until_step and seq_len both strictly increasing")
            out.append(Stage(i, first, st.until_step, st.seq_len))
            first = st.until_step
        out.append(Stage(len(out), first, None, final_seq_len))
        self.stages = out

    def stage_at(self, step: int) -> Stage:
        """The stage that trains optimizer step ``step + 1`` (``step`` steps already done)."""
        for st in self.stages:
            if st.last_step is None or step < st.last_step:
                return st
        raise AssertionError("unreachable: the final stage is open-ended")

    def describe(self) -> str:
        parts = [f"{st.seq_len} until step {st.last_step}" for st in self.stages[:-1]]
        return ", ".join(parts + [f"{self.stages[-1].seq_len} after"])

    def __len__(self) -> int:
        return len(self.stages)

    def lengths(self) -> list[int]:
        """Every window length the run trains on, shortest first."""
        return [st.seq_len for st in self.stages]


class StagedBatches:
    """One step batch per call, from the stage the step belongs to; rebuilds the loader at stage changes."""

    def __init__(
        self,
        data,
        schedule: LengthSchedule,
        per_rank_batch: int,
        *,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        loader_kwargs: dict | None = None,
    ):
        self.schedule, self.per_rank, self.rank, self.world = schedule, per_rank_batch, rank, world
        self.seed, self.loader_kwargs = seed, loader_kwargs or {}
        if isinstance(data, PackedWindows) or torch.as_tensor(data).dim() == 2:
            if len(schedule) > 1:
                raise ValueError("a length curriculum re-windows the token stream: pass 1-D token ids, not windows")
            self.fixed = data if isinstance(data, PackedWindows) else PackedWindows(torch.as_tensor(data), 0)
            self.ids = None
        else:
            self.fixed, self.ids = None, torch.as_tensor(data, dtype=torch.long).reshape(-1)
        self.stage: Stage | None = None
        self.sampler: ResumableBatchSampler | None = None
        self._it: Iterator | None = None

    def _dataset(self, stage: Stage) -> PackedWindows:
        return self.fixed if self.fixed is not None else PackedWindows(self.ids, stage.seq_len)

    def _enter(self, stage: Stage, position: int) -> None:
        ds = self._dataset(stage)
        self.sampler = ResumableBatchSampler(len(ds), self.per_rank, self.rank, self.world, self.seed + stage.index)
        self.sampler.position = position
        self.stage = stage
        self.close()
        self._it = iter(make_loader(ds, self.sampler, **self.loader_kwargs))
        if len(self.schedule) > 1:
            log.info(
                "curriculum stage %d: seq_len %d from step %d (%d windows)", stage.index, stage.seq_len,
                stage.first_step + position + 1, len(ds),
            )

    def next_batch(self, step: int) -> dict[str, torch.Tensor]:
        """The batch of optimizer step ``step + 1``."""
        stage = self.schedule.stage_at(step)
        if self.stage is None or stage.index != self.stage.index:
            self._enter(stage, step - stage.first_step)
        batch = next(self._it)
        self.sampler.position = step + 1 - stage.first_step
        return batch

    @property
    def seq_len(self) -> int:
        return self.stage.seq_len if self.stage else self.schedule.stages[0].seq_len

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "stage": self.stage.index, "seq_len": self.stage.seq_len}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Resume at ``step`` steps done; the checkpoint's stage and length must match this schedule."""
        stage = self.schedule.stage_at(step)
        saved_stage, saved_len = state.get("stage", 0), state.get("seq_len", stage.seq_len)
        if saved_len != stage.seq_len or saved_stage != stage.index:
            # a checkpoint taken on the last step of a stage belongs to that stage, and resumes in the next one
            prev = self.schedule.stages[stage.index - 1] if stage.index else None
            at_boundary = prev is not None and prev.last_step == step
            if not (at_boundary and saved_stage == prev.index and saved_len == prev.seq_len):
                raise ValueError(
                    f"checkpoint at step {step} was in curriculum stage {saved_stage} (seq_len {saved_len}); this "
                    f"run's schedule ({self.schedule.describe()}) puts it in stage {stage.index} (seq_len "
                    f"{stage.seq_len}): resume with the same curriculum and data.seq_len"
                )
            self._enter(stage, step - stage.first_step)
            return
        ds = self._dataset(stage)
        probe = ResumableBatchSampler(len(ds), self.per_rank, self.rank, self.world, self.seed + stage.index)
        probe.load_state_dict({k: v for k, v in state.items() if k not in ("stage", "seq_len")})
        if probe.position != step - stage.first_step:
            raise ValueError(
                f"checkpoint data position {probe.position} does not match step {step} of stage {stage.index}"
            )
        self.seed = probe.seed - stage.index
        self._enter(stage, probe.position)

    def close(self) -> None:
        self._it = None  # drops the loader (and stops its workers)
