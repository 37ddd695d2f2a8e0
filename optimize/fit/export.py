"""``optimize fit --export-finalists K``: the K best finalists exported and measured in the runtime.

The short eval (:mod:`optimize.fit.quality`) measures the exporter's own quantization of the weights
in eager PyTorch: the same weights, not the same kernels. Here the best ``K`` recipes that fit are
lowered exactly as ``fit.yaml`` would lower them (``export.executorch`` with the recipe's block and
``max_seq_len``), then measured through ExecuTorch: the artifact's bytes as written, perplexity on
the same eval windows (the runtime's own arithmetic: XNNPACK's int8 kernels round differently from
torchao's reference), the host's decode rate with ``checks.latency``'s prompt, length and threads,
and the device's decode PREDICTED from that rate (:func:`optimize.footprint.predict.predict`). The winner is
then chosen among the exported recipes by their runtime perplexity. Each artifact stays under
``<out>/finalists/<n>/`` for inspection; ``fit.yaml`` still exports the winner again in its own run
with the pipeline's gates.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from optimize.checks.accuracy import eval_windows, evaluate
from optimize.checks.latency import measure_latency
from optimize.fit import stages as fit_stages
from optimize.footprint.memory import kv_cache_bytes
from optimize.footprint.predict import (
    DevicePrediction,
    bytes_by_scheme,
    nearest_source,
    precision_overlap,
    predict,
    weight_bytes_per_token,
)
from targets.devices import host_bandwidth
from targets.sources.corpus import split_data


def export_finalists(cfg: Any, rows: Sequence[Any], device: Any, out_dir: Path, *, windows: int, seq_len: int,
                     baseline: float, after: Sequence[Path] = (), log: Callable[[str], None] = lambda m: None) -> dict:
    """Export each of ``rows`` (:class:`optimize.footprint.price.Priced`, best first) and set its ``runtime``
    figures; ``windows`` eval windows of ``seq_len`` tokens (the short eval's), perplexity change
    against ``baseline`` (the short eval's fp32 figure). Returns what was measured."""
    import torch

    from export.executorch import ExecuTorchExporter
    model, tokenizer = fit_stages.load_measured(cfg, list(after))
    eval_ids = split_data(cfg.data, tokenizer).eval_ids
    wins = eval_windows(eval_ids, min(cfg.data.seq_len, seq_len))[:windows]
    lat = cfg.checks.latency
    shortest = min(r.max_seq_len for r in rows)
    prompt = eval_ids[: max(1, min(lat.prompt_tokens, shortest - lat.decode_tokens))]
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    exporter = ExecuTorchExporter()
    for i, row in enumerate(rows):
        opts = {**row.export_block(), "max_seq_len": row.max_seq_len}
        res = exporter.export(copy.deepcopy(model), tokenizer, Path(out_dir) / "finalists" / str(i), opts,
                              log=lambda m: None)
        runner = exporter.load(res.artifact)
        with torch.inference_mode():
            ppl = evaluate(runner, wins, desc=row.label()).perplexity
            speed = measure_latency(runner, prompt, lat.decode_tokens, runs=lat.runs, warmup=lat.warmup,
                                    threads=lat.threads)
        size = int(res.manifest["size_bytes"])
        weights = weight_bytes_per_token(size, model.config, res.details, "executorch", tied)
        pred = predict(device, memory=None, host_decode_tok_s=speed["decode_tok_s"],
                       host_bandwidth=host_bandwidth(lat.threads), weight_bytes=weights, config=model.config,
                       context_tokens=speed["prompt_tokens"] + speed["decode_tokens"] // 2,
                       max_seq_len=row.max_seq_len)
        row.runtime = {"artifact": str(res.artifact), "artifact_bytes": size, "perplexity": round(ppl, 4),
                       "perplexity_delta_pct": round(100.0 * (ppl / baseline - 1.0), 3) if math.isfinite(ppl)
                       else math.inf, "host_decode_tok_s": round(speed["decode_tok_s"], 2),
                       "predicted_decode_tok_s": pred.predicted_decode_tok_s,
                       "predicted_decode_tok_s_at_max_seq_len": pred.predicted_decode_tok_s_at_max_seq_len,
                       # what predicts the recipes that were not exported (predict_from_nearest)
                       "host_fraction_of_ceiling": pred.host_fraction_of_ceiling,
                       "host_bandwidth_gb_s": pred.host_bandwidth_gb_s, "context_tokens": pred.context_tokens,
                       "weight_bytes_by_scheme": bytes_by_scheme(model.config, res.details)}
        log(f"fit: exported {i + 1}/{len(rows)} {row.label()}: {size / 2**20:.1f} MiB, perplexity {ppl:.3f} in "
            f"ExecuTorch, host decode {speed['decode_tok_s']:.1f} tok/s, {pred.predicted_decode_tok_s} tok/s "
            f"PREDICTED on {device.name}")
    return {"exported": len(rows), "windows": len(wins), "latency": lat.model_dump(),
            "method": "ExecuTorch (XNNPACK) runtime, the recipe exported as fit.yaml would export it"}


def predict_from_nearest(row: Any, exported: Sequence[Any], device: Any, config: Any) -> dict | None:
    """Decode of a measured recipe that was not exported, PREDICTED from the exported recipe whose
    bytes are read at the most alike precisions (:func:`optimize.footprint.predict.nearest_source`): that
    recipe's measured fraction of the host's bandwidth ceiling, over this recipe's bytes per token,
    on the host and on ``device``. ``config``: the model's (pruned to the row's depth). None where no
    exported recipe has the figures."""
    common = dict(device=device.name, kind=device.kind, usable_memory_bytes=device.usable_bytes,
                  storage_bytes=device.storage_bytes, device_bandwidth_gb_s=device.bandwidth.practical_gb_s)
    sources = {id(r): DevicePrediction(**common, host_fraction_of_ceiling=r.runtime.get("host_fraction_of_ceiling"),
                                       weight_bytes_by_scheme=r.runtime.get("weight_bytes_by_scheme"))
               for r in exported if r.runtime}
    target = DevicePrediction(**common, weight_bytes_by_scheme=row.weight_bytes_by_scheme)
    src = nearest_source(target, list(sources.values()))
    if src is None:
        return None
    origin = next(r for r in exported if r.runtime and sources[id(r)] is src)
    frac = min(src.host_fraction_of_ceiling, 1.0)
    context = origin.runtime.get("context_tokens") or 0
    bpt = row.weight_bytes_per_token + kv_cache_bytes(config, context, positions=context)
    host_bw = origin.runtime.get("host_bandwidth_gb_s")
    return {"source": origin.label(), "precision_overlap": precision_overlap(src, target),
            "host_fraction_of_ceiling": src.host_fraction_of_ceiling, "context_tokens": context,
            "host_decode_tok_s": round(frac * host_bw * 1e9 / bpt, 2) if host_bw else None,
            "predicted_decode_tok_s": round(frac * device.bandwidth.practical_gb_s * 1e9 / bpt, 2)}


__all__ = ["export_finalists", "predict_from_nearest"]
