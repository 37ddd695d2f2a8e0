"""GPTQ's options beyond the defaults: the output-error clip search (``scale_init: output_mse``)
and the damping chosen per layer (``damp: auto``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from optimize import load_config
from optimize.errors import ConfigError
from optimize.quant import gptq as gptq_mod
from optimize.quant.fakequant import scheme_for, weight_scales
from optimize.quant.gptq import DAMP_LADDER, gptq_layer, initial_scales
from optimize.stage_api import StageContext, get_stage


def _skewed(n: int, k: int, seed: int, dead: int = 0) -> torch.Tensor:
    """Activations whose channel scales span ~100x (a few loud channels, many quiet ones), as a
    transformer's; the last ``dead`` channels never fire."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, k)[torch.randperm(k, generator=g)]
    if dead:
        x[:, k - dead:] = 0.0
    return x


def _layer(out_f: int = 64, in_f: int = 128, n: int = 512, seed: int = 0, dead: int = 0):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed + 100)) * 0.05
    x = _skewed(n, in_f, seed, dead)
    return w, x.double().t() @ x.double()


def _diag_error(w: torch.Tensor, scale: torch.Tensor, d: torch.Tensor, scheme) -> float:
    """sum_j diag(H)_j (w_j - q_j s_j)^2 of round-to-nearest on ``scale``: what output_mse minimises."""
    qmin, qmax = scheme.qrange
    gs = w.shape[1] // scale.shape[1]
    wg = w.double().view(w.shape[0], -1, gs)
    s = scale.double().unsqueeze(-1)
    dq = torch.clamp(torch.round(wg / s), qmin, qmax) * s
    return float(((dq - wg).pow(2) * d.double().view(1, -1, gs)).sum())


# ---- scale_init: output_mse


def test_output_mse_scales_never_lose_to_absmax_on_the_weighted_error():
    """The search's grid starts at the max|w| scale, so its diag(H)-weighted error is never larger
    (tolerance: 1e-9 relative, float rounding); on skewed activations it is clearly smaller, and
    smaller than the weight-only mse search's. After GPTQ the full output error follows."""
    scheme = scheme_for("8da4w", 32)
    w, h = _layer()
    d = torch.diag(h).float()
    absmax = initial_scales(w, scheme, "absmax")
    out = initial_scales(w, scheme, "output_mse", d)
    mse = initial_scales(w, scheme, "mse")
    e_abs, e_out, e_mse = (_diag_error(w, s, d, scheme) for s in (absmax, out, mse))
    assert e_out <= e_abs * (1 + 1e-9) and e_out < 0.9 * e_abs, (e_out, e_abs)
    assert e_out <= e_mse * (1 + 1e-9), (e_out, e_mse)
    # the clip search only shrinks: scales within [0.75, 1] x max|w|/7.5, one per (row, group of 32)
    assert out.shape == absmax.shape == (64, 4)
    assert bool((out <= absmax * (1 + 1e-6)).all()) and bool((out >= 0.75 * absmax * (1 - 1e-6)).all())
    r_abs = gptq_layer(w, h, scheme, scale_init="absmax")
    r_out = gptq_layer(w, h, scheme, scale_init="output_mse")
    assert r_out.rel_error_gptq < r_abs.rel_error_gptq, (r_out.rel_error_gptq, r_abs.rel_error_gptq)


def test_output_mse_is_deterministic_and_keeps_the_symmetric_static_layout():
    scheme = scheme_for("8da4w", 32)
    w, h = _layer(out_f=48, dead=32)
    a = gptq_layer(w, h, scheme, scale_init="output_mse")
    b = gptq_layer(w, h, scheme, scale_init="output_mse", rows_per_chunk=7)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    qmin, qmax = scheme.qrange
    assert a.q.dtype == torch.int8 and int(a.q.min()) >= qmin and int(a.q.max()) <= qmax
    assert a.scale.shape == (48, 128 // 32) and bool((a.scale > 0).all())
    # symmetric, zero point 0: every weight is an integer times its group's scale
    assert torch.equal(a.dequantized(), (a.q.float().view(48, 4, 32) * a.scale.unsqueeze(-1)).view(48, 128))
    # a group whose inputs never fire keeps the max|w| scale (nothing to choose by)
    assert torch.equal(a.scale[:, -1], weight_scales(w, scheme)[:, -1])


def test_output_mse_needs_the_hessian_diagonal():
    with pytest.raises(ValueError, match="diagonal"):
        initial_scales(torch.randn(4, 64), scheme_for("8da4w", 32), "output_mse")


# ---- damp: auto


@pytest.mark.parametrize("scale_init", ["mse", "output_mse"])
def test_damp_auto_picks_the_ladder_value_with_the_lowest_output_error(scale_init):
    scheme = scheme_for("8da4w", 32)
    w, h = _layer()
    auto = gptq_layer(w, h, scheme, damp="auto", scale_init=scale_init)
    assert auto.damp in DAMP_LADDER
    fixed = {d: gptq_layer(w, h, scheme, damp=d, scale_init=scale_init) for d in DAMP_LADDER}
    # float32 products in the report's error (MKL's results may move in the last bits with the buffers' alignment)
    assert auto.rel_error_gptq == pytest.approx(min(r.rel_error_gptq for r in fixed.values()), rel=1e-6)
    # the layer's integers are those of the fixed damp it chose
    assert torch.equal(auto.q, fixed[auto.damp].q) and torch.equal(auto.scale, fixed[auto.damp].scale)
    again = gptq_layer(w, h, scheme, damp="auto", scale_init=scale_init)
    assert again.damp == auto.damp and torch.equal(again.q, auto.q)


def test_damp_auto_on_a_sample_of_rows_then_all_rows_with_the_choice(monkeypatch):
    """A layer with more rows than AUTO_DAMP_ROWS compares the ladder on evenly spaced rows, then
    quantizes every row (in chunks) with the winner: the same integers as that fixed damp."""
    monkeypatch.setattr(gptq_mod, "AUTO_DAMP_ROWS", 16)
    scheme = scheme_for("8da4w", 32)
    w, h = _layer(out_f=100)
    auto = gptq_layer(w, h, scheme, damp="auto", rows_per_chunk=30)
    fixed = gptq_layer(w, h, scheme, damp=auto.damp)
    assert auto.damp in DAMP_LADDER and torch.equal(auto.q, fixed.q)
    # the report's error is multiplied in float32 (optimize/quant/gptq.py _relative_errors), and a chunk of 30 rows
    # takes another BLAS kernel than 100: the figures agree to float32's precision, not bit for bit (1e-12 failed
    # in a CI run by 3e-10)
    assert auto.rel_error_gptq == pytest.approx(fixed.rel_error_gptq, rel=1e-6)


def test_damp_auto_survives_a_singular_hessian():
    """Dead input channels and fewer tokens than channels (rank 40 of 128): the ladder still
    factorises and GPTQ still beats round-to-nearest on the calibration rows."""
    scheme = scheme_for("8da4w", 32)
    w, h = _layer(n=40, dead=16)
    assert int(torch.linalg.matrix_rank(h)) <= 40
    res = gptq_layer(w, h, scheme, damp="auto")
    assert res.damp in DAMP_LADDER and torch.isfinite(res.scale).all()
    assert res.rel_error_gptq < res.rel_error_rtn


def test_damp_auto_steps_up_when_the_factorisation_fails(monkeypatch):
    real = gptq_mod._inverse_factor

    def fails_below(limit):
        def fn(h, damp):
            if damp < limit:
                raise torch.linalg.LinAlgError("forced by the test")
            return real(h, damp)
        return fn

    scheme = scheme_for("8da4w", 32)
    w, h = _layer()
    monkeypatch.setattr(gptq_mod, "_inverse_factor", fails_below(0.05))
    assert gptq_layer(w, h, scheme, damp="auto").damp == 0.1  # the only ladder value left
    monkeypatch.setattr(gptq_mod, "_inverse_factor", fails_below(0.2))
    assert gptq_layer(w, h, scheme, damp="auto").damp == 0.3  # beyond the ladder
    monkeypatch.setattr(gptq_mod, "_inverse_factor", fails_below(2.0))
    with pytest.raises(ValueError, match="not positive definite with any damp"):
        gptq_layer(w, h, scheme, damp="auto")


def test_gptq_layer_rejects_an_unknown_damp_word():
    with pytest.raises(ValueError, match="'auto'"):
        gptq_layer(torch.randn(8, 64), torch.eye(64), scheme_for("8da4w", 32), damp="bogus")


# ---- the stage: config, summary, installed layout


def _stage(tiny_cfg, **gptq):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "algorithm": "gptq", "keep_high_precision": [],
                           "gptq": gptq}]
    return load_config(tiny_cfg).stages[0]


def test_config_accepts_auto_and_rejects_other_words(tiny_cfg):
    assert _stage(tiny_cfg, damp="auto").gptq.damp == "auto"
    assert _stage(tiny_cfg, damp=0.03).gptq.damp == 0.03
    assert _stage(tiny_cfg, scale_init="output_mse").gptq.scale_init == "output_mse"
    with pytest.raises(ConfigError, match=r"stages\.0\.gptq\.damp.*number in \(0, 1\) or 'auto', got 'bogus'"):
        _stage(tiny_cfg, damp="bogus")
    with pytest.raises(ConfigError, match=r"stages\.0\.gptq\.damp.*\(0, 1\)"):
        _stage(tiny_cfg, damp=0.0)


def test_stage_with_output_mse_and_damp_auto_reports_the_chosen_damps(tiny_llama, tiny_cfg, tmp_path):
    from torchao.quantization import IntxUnpackedToInt8Tensor

    g = torch.Generator().manual_seed(3)
    wins = [torch.randint(0, 1000, (64,), generator=g) for _ in range(2)]
    ctx = StageContext(tokenizer=None, calibration=wins, train_ids=torch.zeros(0, dtype=torch.long),
                       target=None, work_dir=Path(tmp_path), log=lambda s: None)
    model = get_stage("ptq_int8").fn(tiny_llama, _stage(tiny_cfg, damp="auto", scale_init="output_mse"), ctx)
    d = ctx.details["gptq"]
    assert d["damp"] == "auto" and d["scale_init"] == "output_mse"
    assert sum(d["damp_counts"].values()) == d["layers"] == 15
    assert {float(k) for k in d["damp_counts"]} <= set(DAMP_LADDER)
    assert sum(sum(c.values()) for c in d["damp_by_projection"].values()) == 15 and "lm_head" in d["damp_by_projection"]
    assert d["output_error_reduction"] > 0
    down = model.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, IntxUnpackedToInt8Tensor) and down.target_dtype == torch.int4
    assert list(down.block_size) == [1, 32] and not bool(down.zero_point.any())
    assert int(down.qdata.min()) >= -8 and int(down.qdata.max()) <= 7
