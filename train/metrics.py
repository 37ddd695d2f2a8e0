"""Step metrics to a tqdm bar, an appendable CSV and (only if installed) TensorBoard; rank 0 only.

Rows arrive in bursts: the loop keeps each step's loss and gradient norm on the device and reads
them back once per logging interval (``logging.every_n_steps``), so ``tokens_per_s`` and ``mfu``
of a row are the averages over the interval it closed. ``mfu`` is empty where the device's peak
is unknown (see ``train/flops.py``).
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
from pathlib import Path

from train.config import LoggingConfig

log = logging.getLogger("optimize.train")

FIELDS = [
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mib", "micro_batch_size", "grad_accum_steps",
    "seq_len",
]


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, output_dir: Path, total_steps: int, start_step: int, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        self.bar = self.tb = None
        self.csv_path = Path(output_dir) / "metrics.csv"
        if not enabled:
            return
        if cfg.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if cfg.tensorboard:
            if importlib.util.find_spec("tensorboard") is None:
                log.warning("logging.tensorboard: the tensorboard package is not installed; skipping it")
            else:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if row["step"] % self.cfg.every_n_steps == 0:
                self.bar.set_postfix(
                    loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", mem=f"{row['peak_mem_mib']:.0f}M"
                )
        if row["step"] % self.cfg.every_n_steps:
            return
        if self.cfg.csv:
            new = not self.csv_path.exists()
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.csv_path, "a", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
                if new:
                    w.writeheader()
                w.writerow(row)
                fh.flush()
                os.fsync(fh.fileno())
        if self.tb is not None:
            for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mib"):
                if row.get(k) is not None:
                    self.tb.add_scalar(f"train/{k}", row[k], row["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
