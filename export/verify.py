"""Runtime-agnostic checks of an exported model, written only against :class:`Runner`.

The pipeline and the benchmarks measure eager models, ExecuTorch programs and ONNX sessions
with these same few functions, so a figure means the same thing whichever runtime produced
it. Nothing here knows about a particular runtime.
"""

from __future__ import annotations

import statistics
import time
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from export.decoding.runtime import Runner, argmax_ids, first_divergence, greedy_generate


def _ids(x: Iterable[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(list(x) if not isinstance(x, torch.Tensor) else x, dtype=torch.long)
    return t.reshape(-1)


def _check_fits(runner: Runner, n: int, what: str) -> None:
    limit = runner.max_seq_len
    if limit is not None and n > limit:
        raise ValueError(
            f"{what} needs {n} positions but the {runner.runtime} runner holds max_seq_len={limit}"
        )


def logits_parity(ref: Runner, test: Runner, windows: Sequence[torch.Tensor]) -> dict:
    """Compare all-position logits of ``test`` against ``ref`` over each window from a clean cache.

    ``max_abs_diff`` is the largest elementwise logit difference; ``top1_agreement`` the
    fraction of positions whose argmax token is the same; ``tokens`` the positions compared.
    """
    if not windows:
        raise ValueError("logits_parity needs at least one window")
    max_diff = 0.0
    agree = 0
    total = 0
    for w in windows:
        w = _ids(w)
        _check_fits(test, w.numel(), "a parity window")
        ref.reset()
        test.reset()
        a = ref.forward(w, all_logits=True).float()
        b = test.forward(w, all_logits=True).float()
        if a.shape != b.shape:
            raise ValueError(f"logit shapes differ: {ref.runtime} {tuple(a.shape)} vs {test.runtime} {tuple(b.shape)}")
        max_diff = max(max_diff, float((a - b).abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += int(w.numel())
    return {"max_abs_diff": max_diff, "top1_agreement": agree / total, "tokens": total}


def perplexity(runner: Runner, ids: torch.Tensor, seq_len: int) -> dict:
    """Perplexity over non-overlapping windows of ``seq_len`` inputs, each from a clean cache.

    Window ``k`` feeds ``ids[k*seq_len : (k+1)*seq_len]`` and scores the next token at every
    position, so ``N+1`` ids give ``N`` targets (4097 ids -> 4096 targets, the project's
    reference). NLL is summed over all targets and ``exp(mean)`` returned.
    """
    ids = _ids(ids)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 token ids")
    _check_fits(runner, min(seq_len, ids.numel() - 1), "a perplexity window")
    nll = 0.0
    n = 0
    for start in range(0, ids.numel() - 1, seq_len):
        inputs = ids[start : start + seq_len]
        targets = ids[start + 1 : start + seq_len + 1]
        inputs = inputs[: targets.numel()]
        runner.reset()
        logits = runner.forward(inputs, all_logits=True).float()
        nll += float(F.cross_entropy(logits, targets, reduction="sum"))
        n += int(targets.numel())
    mean = nll / n
    return {"perplexity": float(torch.exp(torch.tensor(mean))), "nll": mean, "tokens": n}


def greedy_match(ref: Runner, test: Runner, prompt_ids, n: int) -> dict:
    """Greedy-decode ``n`` tokens with both runners; ``diverged_at`` is the first differing index."""
    prompt = _ids(prompt_ids)
    r = greedy_generate(ref, prompt, n)
    t = greedy_generate(test, prompt, n)
    diverged = first_divergence(r, t)
    return {"match": diverged is None, "diverged_at": diverged, "ref_ids": r, "test_ids": t}


def latency(runner: Runner, prompt_ids, decode_tokens: int, runs: int = 3, warmup: int = 1) -> dict:
    """Median prefill time (ms) of ``prompt_ids`` and median greedy decode speed (tokens/s).

    Each run resets the runner, prefills the prompt, then decodes ``decode_tokens`` tokens one
    at a time (argmax, no EOS stop, so every run does the same work). ``warmup`` runs first
    are discarded.
    """
    prompt = _ids(prompt_ids)
    if runs < 1 or warmup < 0 or decode_tokens < 1:
        raise ValueError("latency needs runs >= 1, warmup >= 0, decode_tokens >= 1")
    _check_fits(runner, prompt.numel() + decode_tokens, "latency (prompt + decode)")
    prefill, decode = [], []
    for i in range(warmup + runs):
        runner.reset()
        t0 = time.perf_counter()
        logits = runner.forward(prompt, all_logits=False)
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            nxt = torch.tensor(argmax_ids(logits[-1]), dtype=torch.long)  # not torch's pool (argmax_ids)
            logits = runner.forward(nxt, all_logits=False)
        t2 = time.perf_counter()
        if i >= warmup:
            prefill.append((t1 - t0) * 1000.0)
            decode.append(decode_tokens / (t2 - t1))
    return {
        "prefill_ms": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "prompt_tokens": int(prompt.numel()),
        "decode_tokens": decode_tokens,
        "runs": runs,
    }
