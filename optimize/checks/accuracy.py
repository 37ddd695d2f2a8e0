"""Perplexity, top-1 agreement and KL divergence against the baseline, in one pass.

Perplexity follows the project's reference method: non-overlapping windows, no cache
between windows, summed NLL over every target, ``exp(mean)``. Agreement and KL compare each
position's next-token distribution with the baseline's, which is stored once (fp16
log-probabilities) when the baseline is measured. fp16 halves the memory (4096 positions of
a 49k vocabulary take 400 MB) and puts a floor of about 1e-5 nats under the KL of an
unchanged model, far below what any quantization scheme costs (1e-2 and up). A pipeline run keeps
them on disk instead (:class:`BaselineLogits` with a ``directory``), one window read back at a
time: with a 128256-token vocabulary (Llama 3) they are 1 GB, a third of a bf16 1B model's bytes,
held for the whole run beside the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from export.decoding.runtime import Runner


@dataclass
class BaselineLogits:
    """The baseline's log-probabilities per window (fp16 to halve memory) and argmax ids.

    With ``directory`` set, each window's log-probabilities go to a file there as they are kept
    and are read back one window at a time (:meth:`logprobs_at`), so none stays in memory: the
    same fp16 values (a scored window's KL is unchanged to the bit), for a 1B model with a
    128256-token vocabulary 1 GB of resident memory fewer during the whole run (4096 positions).
    The caller owns the directory (the pipeline deletes it when the run ends)."""

    logprobs: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)
    directory: Path | None = None
    #: how many windows' log-probabilities sit in ``directory``
    spilled: int = 0

    def add(self, logprobs: torch.Tensor, top1: torch.Tensor) -> None:
        """Keep one window's fp16 log-probabilities (on disk with a ``directory``) and argmax ids."""
        self.top1.append(top1)
        if self.directory is None:
            self.logprobs.append(logprobs)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(logprobs, self._file(self.spilled))
        self.spilled += 1

    def logprobs_at(self, i: int) -> torch.Tensor:
        """Window ``i``'s fp16 log-probabilities, from memory or read back from ``directory``."""
        if self.directory is None:
            return self.logprobs[i]
        if not 0 <= i < self.spilled:
            raise IndexError(f"baseline window {i} was not kept ({self.spilled} windows)")
        return torch.load(self._file(i), map_location="cpu", weights_only=True)

    def __len__(self) -> int:
        return len(self.top1)

    def _file(self, i: int) -> Path:
        return Path(self.directory) / logprobs_file(i)


def logprobs_file(i: int) -> str:
    """The name of window ``i``'s log-probability file (in a spill directory or a cache entry)."""
    return f"logprobs-{i:05d}.pt"


@dataclass
class AccuracyResult:
    perplexity: float
    nll: float
    tokens: int
    top1_agreement: float | None = None
    kl_divergence: float | None = None
    #: positions where the runner's argmax equals the target token (plain accuracy)
    next_token_accuracy: float | None = None


def eval_windows(eval_ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Windows of ``seq_len + 1`` ids (inputs plus the shifted targets), non-overlapping."""
    n_targets = int(eval_ids.numel()) - 1
    out = []
    for start in range(0, n_targets, seq_len):
        w = eval_ids[start : min(start + seq_len, n_targets) + 1]
        if w.numel() >= 2:
            out.append(w)
    return out


def evaluate(
    runner: Runner,
    windows: list[torch.Tensor],
    baseline: BaselineLogits | None = None,
    *,
    keep: BaselineLogits | None = None,
    desc: str = "eval",
) -> AccuracyResult:
    """Score ``windows`` through ``runner``. With ``baseline``, also agreement and KL.
    With ``keep``, store this runner's log-probs there (to become the baseline)."""
    total_nll = 0.0
    total = 0
    agree = 0
    correct = 0
    kl_sum = 0.0
    for i, w in enumerate(tqdm(windows, desc=desc, leave=False, unit="win")):
        inputs, targets = w[:-1], w[1:]
        runner.reset()
        logits = runner.forward(inputs, all_logits=True).float()
        if logits.shape[0] != targets.numel():
            raise RuntimeError(f"{runner.runtime} returned {logits.shape[0]} positions for {targets.numel()} inputs")
        device = logits.device  # the scores are computed where the runner left its logits (a GPU's eager model)
        targets = targets.to(device)
        logp = F.log_softmax(logits, dim=-1)
        total_nll += float(-logp.gather(1, targets.view(-1, 1)).sum())
        total += targets.numel()
        top = logits.argmax(-1)
        correct += int((top == targets).sum())
        if baseline is not None:
            base_lp = baseline.logprobs_at(i).to(device).float()
            agree += int((top == baseline.top1[i].to(device)).sum())
            # KL(baseline || runner), per position, in nats
            kl_sum += float((base_lp.exp() * (base_lp - logp)).sum())
        if keep is not None:  # on the CPU: the exported artifacts are scored against it there
            keep.add(logp.to(torch.float16).cpu(), top.cpu())
    mean_nll = total_nll / max(total, 1)
    return AccuracyResult(
        perplexity=math.exp(mean_nll),
        nll=mean_nll,
        tokens=total,
        top1_agreement=(agree / total) if baseline is not None else None,
        kl_divergence=(kl_sum / total) if baseline is not None else None,
        next_token_accuracy=correct / max(total, 1),
    )
