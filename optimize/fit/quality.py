"""Measured accuracy for ``optimize fit``'s finalists, so the winner is chosen by a perplexity, not a guess.

Bytes price every recipe in milliseconds (:mod:`optimize.fit.search`); the ones that fit the device go on
here, best-looking first. Each is applied to a copy of the model exactly as the ExecuTorch exporter
applies it (``export.executorch.quant.apply_quantization``: torchao's 8da8w / 8da4w Linear layers, the
``lm_head`` choice, the embedding table's weight-only int8/int4), so the weights measured are the
weights the ``.pte`` would hold; perplexity is taken in eager PyTorch on the first ``windows`` windows
of the pipeline's own eval split (``data``). That short eval ranks the recipes; the full figure, in
the runtime, comes from running the ``fit.yaml`` it writes. Stages of the YAML that do not quantize
(distillation, rewrites) are not run here: the recipes are measured on the model after the ones a run
of the YAML already finished (:mod:`optimize.fit.stages`), else on the model as loaded.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Sequence

from export.decoding.runtime import EagerRunner
from optimize.checks.accuracy import eval_windows, evaluate
from optimize.fit import stages as fit_stages
from targets.sources.corpus import split_data


def measure_finalists(cfg: Any, rows: Sequence[Any], *, max_seq_len: int, windows: int,
                      log: Callable[[str], None] = lambda m: None, after: Sequence[Any] = (),
                      baseline: float | None = None) -> dict:
    """Set ``perplexity`` and ``perplexity_delta_pct`` on each of ``rows`` (:class:`optimize.footprint.price.Priced`);
    returns what was measured (baseline perplexity, the unquantized model's as ``model_perplexity``,
    windows, tokens, on which model). ``after``: the finished stage checkpoints to start from
    (:func:`optimize.fit.stages.finished`, or a depth's healed run); ``baseline``: the perplexity the
    changes are against (default: this model's unquantized one; a pruned model's is the unpruned's)."""
    import torch

    from export.executorch import ExecuTorchOptions, apply_quantization

    if windows < 1:
        raise ValueError(f"windows must be >= 1, got {windows}")
    model, tokenizer = fit_stages.load_measured(cfg, list(after))
    wins = eval_windows(split_data(cfg.data, tokenizer).eval_ids, min(cfg.data.seq_len, max_seq_len))[:windows]
    tokens = sum(int(w.numel()) - 1 for w in wins)
    with torch.inference_mode():
        own = evaluate(EagerRunner(model), wins, desc="fp32").perplexity
    base = own if baseline is None else baseline
    log(f"fit: fp32 perplexity {own:.3f} on {len(wins)} windows ({tokens} tokens)"
        + (f", {100.0 * (own / base - 1.0):+.2f}% against {base:.3f}" if baseline is not None else ""))
    for i, row in enumerate(rows):
        quantized = copy.deepcopy(model)
        apply_quantization(quantized, ExecuTorchOptions.model_validate({**row.export_block(),
                                                                         "max_seq_len": max_seq_len}))
        with torch.inference_mode():
            ppl = evaluate(EagerRunner(quantized), wins, desc=row.label()).perplexity
        del quantized
        row.perplexity = round(ppl, 4)
        row.perplexity_delta_pct = round(100.0 * (ppl / base - 1.0), 3) if math.isfinite(ppl) else math.inf
        log(f"fit: {i + 1}/{len(rows)} {row.label()}: perplexity {ppl:.3f} ({row.perplexity_delta_pct:+.2f}%)")
    return {"baseline_perplexity": round(base, 4), "model_perplexity": round(own, 4), "windows": len(wins),
            "tokens": tokens,
            "method": "eager PyTorch, the exporter's own quantization of the weights",
            "model": fit_stages.describe(cfg, list(after))}


__all__ = ["measure_finalists"]
