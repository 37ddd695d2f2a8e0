"""What an artifact computes, measured the same way on the host and inside the ARM64 guest.

:func:`probe` runs greedy decoding from each prompt (keeping every step's logits) and scores
perplexity windows (keeping every position's logits), through the project's own runners. The
host calls it in-process on its x86-64 runtime build; :mod:`export.arm64.verify` runs this module
as a script under QEMU on the ARM64 build, so both sides execute the same code and only the
runtime's binaries differ. Run as ``python -m export.arm64.probe REQUEST.json``: it writes the
logits to ``REQUEST``'s folder and prints the summary as JSON on its last line.

It imports only ``torch``, ``numpy``, the runtimes and :mod:`export`'s runners: the guest has no
transformers (the exporters import it), so :func:`open_runner` picks the runner itself, by the
same rules as the exporters' ``load``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

GENAI_CONFIG = "genai_config.json"  # export.onnxruntime.exporter's GENAI_CONFIG (not imported: transformers)


def open_runner(path: Path, threads: int | None = None):
    """``.pte`` -> ExecuTorch; ``.onnx`` -> an ONNX Runtime session; a folder with
    ``genai_config.json`` (or that file) -> onnxruntime-genai, as the exporters' ``load`` choose."""
    path = Path(path)
    if path.suffix == ".pte":
        from export.executorch.runner import ExecuTorchRunner

        return ExecuTorchRunner(path, threads=threads)
    if path.is_dir() or path.name == GENAI_CONFIG:
        folder = path if path.is_dir() else path.parent
        if (folder / GENAI_CONFIG).is_file():
            from export.onnxruntime.genai_runner import GenaiRunner

            return GenaiRunner(folder)
        path = folder / "model.onnx"
    if path.suffix == ".onnx":
        from export.onnxruntime.runner import OnnxRuntimeRunner

        return OnnxRuntimeRunner(path)
    raise ValueError(f"no runner for {path}: give a .pte, a .onnx or an onnxruntime-genai folder")


class _Recording:
    """A runner that keeps the last position's logits of every call (greedy's choices)."""

    def __init__(self, runner):
        self._runner = runner
        self.steps: list[torch.Tensor] = []

    def forward(self, ids, *, all_logits: bool = True):
        out = self._runner.forward(ids, all_logits=all_logits)
        self.steps.append(out[-1].float().clone())
        return out

    def __getattr__(self, name):
        return getattr(self._runner, name)


def probe(artifact: Path, prompts: list[list[int]], new_tokens: int, windows: list[list[int]], out: Path,
          threads: int | None = None) -> dict:
    """Greedy ids from each prompt and each window's NLL; logits saved to ``out/<tag>.npz``."""
    from export.decoding.runtime import greedy_generate

    t0 = time.perf_counter()
    runner = open_runner(artifact, threads)
    t_load = time.perf_counter() - t0
    greedy, step_logits = [], {}
    for i, prompt in enumerate(prompts):
        rec = _Recording(runner)
        greedy.append(greedy_generate(rec, prompt, new_tokens))
        step_logits[f"greedy{i}"] = torch.stack(rec.steps[: len(greedy[-1])]).numpy()
    nll, tokens, per_window = 0.0, 0, []
    for i, window in enumerate(windows):
        ids = torch.tensor(window, dtype=torch.long)
        runner.reset()
        logits = runner.forward(ids[:-1], all_logits=True).float()
        per_window.append(float(F.cross_entropy(logits, ids[1:], reduction="sum")))
        nll += per_window[-1]
        tokens += ids.numel() - 1
        step_logits[f"window{i}"] = logits.numpy()
    np.savez(out, **step_logits)
    return {"runtime": runner.runtime, "greedy": greedy, "nll": nll, "tokens": tokens, "window_nll": per_window,
            "perplexity": float(np.exp(nll / tokens)) if tokens else None,
            "seconds": {"load": round(t_load, 2), "total": round(time.perf_counter() - t0, 2)}}


def main(argv: list[str]) -> int:
    request = Path(argv[0])
    req = json.loads(request.read_text())
    rep = probe(Path(req["artifact"]), req["prompts"], req["new_tokens"], req["windows"],
                request.with_name(req["tag"] + ".npz"), req.get("threads"))
    import platform

    rep["machine"] = platform.machine()
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
