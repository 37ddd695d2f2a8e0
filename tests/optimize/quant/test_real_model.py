"""SmolLM2-135M (slow): the folds stay exact on the real model and AWQ lowers 8da4w error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow


def _kl(model, ref_logits, ids):
    lp = torch.log_softmax(model(ids).logits.float(), -1)
    ref = torch.log_softmax(ref_logits, -1)
    return float((ref.exp() * (ref - lp)).sum(-1).mean())


def test_smoothquant_exact_and_awq_helps_on_smollm2(smollm2_loaded, pydoc_splits):
    from optimize.quant.awq import awq_scale
    from optimize.quant.fakequant import fake_quantized, scheme_for
    from optimize.quant.smoothquant import smooth

    model = copy.deepcopy(smollm2_loaded.model).eval()
    calib = [pydoc_splits.calib_ids[i : i + 256] for i in (0, 256)]
    ids = pydoc_splits.eval_ids[:256].view(1, -1)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    sch = scheme_for("8da4w", 32)
    with torch.no_grad():
        ref = model(ids).logits.float()
        with fake_quantized(model, names, sch):
            kl_rtn = _kl(model, ref, ids)
        sq = copy.deepcopy(model)
        smooth(sq, calib, alpha=0.5, folds=("qkv", "gate_up", "down", "o"))
        assert (sq(ids).logits - ref).abs().max() < 1e-3 * ref.abs().max()
        del sq
        res = awq_scale(model, calib, sch, rows=256)
        assert (model(ids).logits - ref).abs().max() < 1e-3 * ref.abs().max()
        with fake_quantized(model, names, sch):
            kl_awq = _kl(model, ref, ids)
    assert res.error_awq < res.error_rtn
    assert kl_awq < kl_rtn
