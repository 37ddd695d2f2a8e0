"""How exact are the "exact" folds on a real model? The figures behind the default tolerance.

Runs ``smoothquant`` and ``awq`` (the stages' own code, through the stage functions) on the real
SmolLM2-135M, in fp32 and bf16, and prints the largest logit difference before/after the fold on
calibration windows (pydoc text after the evaluation span, 512-token windows, the first
``--tokens`` of ``--windows`` windows), relative to the largest logit: the quantity the stages'
exactness check compares with ``exactness.tolerance``. For contrast it also applies a *wrong*
fold (the norm divided by ``s`` as if it computed ``x * w`` when it computes ``x * (1 + w)``,
the Gemma bug) to a tiny random Gemma2 and prints what the check sees.

    flock /tmp/heavy.lock .venv/bin/python bench/fold_exactness.py
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = [
    ("smoothquant", {"alpha": 0.5}),
    ("smoothquant", {"alpha": 0.8}),
    ("awq", {"scheme": "8da4w", "keep_high_precision": []}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("OPTIMIZE_CACHE", os.path.expanduser("~/.cache/edge-optimize"))

    from optimize.rewrites.exactness import ExactnessConfig, ExactnessProbe, probe_windows
    from optimize.stage_api import StageContext, get_stage
    from targets.sources.corpus import load_text, split_corpus, tokenize
    from targets.sources.corpus import windows as cut
    from targets.sources import BundledSource, load_model

    loaded = load_model(BundledSource(name="smollm2-135m"))
    ids = tokenize(load_text("pydoc"), loaded.tokenizer)
    splits = split_corpus(ids, eval_tokens=4096, calib_tokens=4096)
    calib = cut(splits.calib_ids, 512)
    check = ExactnessConfig(windows=args.windows, tokens=args.tokens, tolerance=1.0)
    wins = probe_windows(calib, check)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for kind, params in VARIANTS:
            model = copy.deepcopy(loaded.model).to(dtype).eval()
            spec = get_stage(kind)
            cfg = spec.config_cls.model_validate({"kind": kind, **params, "exactness": {"tolerance": 1.0}})
            probe = ExactnessProbe.before(model, wins, check)
            ctx = StageContext(tokenizer=None, calibration=calib, train_ids=splits.train_ids, target=None,
                               work_dir=Path("/tmp"), log=lambda m: None)
            spec.fn(model, cfg, ctx)
            f = probe.after(model, kind)
            rows.append((f"SmolLM2-135M {dtype_name}", f"{kind} {params}", f))
            del model

    rows.append(("tiny random gemma2 fp32", "wrong fold: norm w / s (ignores 1 + w)", _wrong_gemma_fold(check)))
    print(f"\n{args.windows} calibration windows x {args.tokens} tokens; relative = max|dlogit| / max|logit|\n")
    print("| model | fold | max abs diff | logit scale | relative |")
    print("|---|---|---:|---:|---:|")
    for model, fold, f in rows:
        print(f"| {model} | {fold} | {f['max_abs_logit_diff']:.3g} | {f['logit_scale']:.3g} | {f['relative_diff']:.3g} |")


def _wrong_gemma_fold(check) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimize.quant.equalize import collect_stats, fold_groups
    from optimize.quant.smoothquant import smooth_scales
    from optimize.rewrites.exactness import ExactnessProbe

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                               pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    wins = [torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    probe = ExactnessProbe.before(model, wins, check)
    groups = fold_groups(model, ("qkv",))
    stats = collect_stats(model, groups, wins)
    with torch.no_grad():
        for g in groups:
            s = smooth_scales(stats[g.name].absmax, [model.get_submodule(n).weight for n in g.linears], 0.5)
            model.get_submodule(g.source).weight.div_(s)  # the old, wrong fold for (1 + w) norms
            for n in g.linears:
                model.get_submodule(n).weight.mul_(s)
    return probe.after(model, "wrong fold")


if __name__ == "__main__":
    main()
