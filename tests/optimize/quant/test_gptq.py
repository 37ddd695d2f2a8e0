"""GPTQ: beats round-to-nearest on output error, keeps torchao's XNNPACK layout, validates input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optimize import load_config
from optimize.errors import ConfigError
from optimize.quant.fakequant import qdq_act_per_token, qdq_weight, scheme_for
from optimize.quant.gptq import gptq_layer
from optimize.quant.gptq_sequential import gptq_model
from optimize.stage_api import StageContext, get_stage


def _correlated_inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows with correlated channels and a few large ones, like a transformer's activations; one
    fixed channel mix, ``seed`` draws the rows (so calibration and held-out share a distribution)."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(99)) / k**0.5
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) @ (torch.eye(k) + 0.8 * mix)
    x[:, :4] *= 6.0
    return x


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, None)])
def test_gptq_beats_round_to_nearest_on_held_out_rows(bits, group_size):
    """Reconstruction error ||XW^T - XQ^T|| on rows GPTQ never saw, against RTN's, same scheme."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.05
    calib, held_out = _correlated_inputs(1024, 128, 1), _correlated_inputs(512, 128, 2)
    scheme = scheme_for("w4" if bits == 4 else "w8", group_size)
    res = gptq_layer(w, calib.t().double() @ calib.double(), scheme, scale_init="absmax")
    ref = held_out @ w.t()
    err_gptq = (held_out @ res.dequantized().t() - ref).pow(2).sum() / ref.pow(2).sum()
    err_rtn = (held_out @ qdq_weight(w, scheme).t() - ref).pow(2).sum() / ref.pow(2).sum()
    assert err_gptq < 0.8 * err_rtn, (float(err_gptq), float(err_rtn))
    # the reported figures are the same quantities on the calibration rows
    assert res.rel_error_gptq < res.rel_error_rtn
    qmin, qmax = scheme.qrange
    assert res.q.dtype == torch.int8 and int(res.q.min()) >= qmin and int(res.q.max()) <= qmax
    assert res.scale.shape == (96, 128 // (group_size or 128))


@pytest.mark.parametrize("scale_init", ["absmax", "mse"])
def test_rows_in_chunks_give_the_same_integers(scale_init):
    """GPTQ's rows are independent given the Hessian: a 1B-class output head (128256 rows) goes
    through in chunks (its float64 copies were 2.1 GB each: 22.5 GB RSS), with the same result."""
    from optimize.quant.fakequant import scheme_for

    w = torch.randn(300, 128, generator=torch.Generator().manual_seed(1))
    x = _correlated_inputs(512, 128, seed=2)
    h = x.double().t() @ x.double()
    whole = gptq_layer(w, h, scheme_for("8da4w", 32), scale_init=scale_init)
    parts = gptq_layer(w, h, scheme_for("8da4w", 32), scale_init=scale_init, rows_per_chunk=37)
    assert torch.equal(whole.q, parts.q) and torch.equal(whole.scale, parts.scale)
    # the report's errors are multiplied in float32, by another BLAS kernel for 37 rows than for 300: equal to
    # float32's precision (the integers above are equal bit for bit)
    assert parts.rel_error_gptq == pytest.approx(whole.rel_error_gptq, rel=1e-6)
    assert parts.rel_error_rtn == pytest.approx(whole.rel_error_rtn, rel=1e-6)



@pytest.mark.parametrize("scale_init", ["absmax", "mse", "output_mse"])
def test_layers_sharing_an_input_stacked_give_each_its_own_result(scale_init):
    """q/k/v (and gate/up) share one Hessian: stacked through one column loop, each layer gets
    exactly the integers, scales and errors it gets alone (rows are independent given H)."""
    from optimize.quant.gptq import gptq_layers

    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(rows, 128, generator=g) * 0.05 for rows in (64, 32, 32)]
    x = _correlated_inputs(512, 128, seed=4)
    h = x.double().t() @ x.double()
    scheme = scheme_for("8da4w", 32)
    stacked = gptq_layers(ws, h, scheme, scale_init=scale_init)
    for w, res in zip(ws, stacked, strict=True):
        alone = gptq_layer(w, h, scheme, scale_init=scale_init)
        assert res.q.shape == w.shape
        assert torch.equal(res.q, alone.q) and torch.equal(res.scale, alone.scale)
        assert res.rel_error_gptq == alone.rel_error_gptq and res.rel_error_rtn == alone.rel_error_rtn
    with pytest.raises(ValueError, match="do not match"):
        gptq_layers([ws[0], torch.randn(8, 64)], h, scheme)



def test_the_callers_hessian_is_left_alone_unless_given_up():
    """GPTQ fixes dead inputs' diagonal and damps a copy; ``consume_hessian`` (the model run, which
    drops each Hessian after its solve) changes the given float64 Hessian in place instead, with
    the same result, to spare a 512 MiB copy for an 8192-input Linear."""
    from optimize.quant.gptq import gptq_layers

    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(6))
    x = _correlated_inputs(512, 128, seed=7)
    x[:, 100:] = 0.0  # dead inputs: their diagonal is zero
    h = x.double().t() @ x.double()
    kept = h.clone()
    scheme = scheme_for("8da4w", 32)
    alone = gptq_layer(w, h, scheme)
    assert torch.equal(h, kept)
    given = gptq_layers([w], h, scheme, consume_hessian=True)[0]
    assert torch.equal(given.q, alone.q) and given.rel_error_gptq == alone.rel_error_gptq
    assert not torch.equal(h, kept)  # its dead diagonal was set to 1 in place

def test_gptq_rejects_mismatched_shapes_and_bad_damp():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="do not match"):
        gptq_layer(w, torch.eye(32), scheme_for("w4", 32))
    with pytest.raises(ValueError, match="damp"):
        gptq_layer(w, torch.eye(64), scheme_for("w4", 32), damp=0.0)
    with pytest.raises(ValueError, match="does not divide"):
        gptq_layer(torch.randn(8, 48), torch.eye(48), scheme_for("w4", 32))
    with pytest.raises(ValueError, match="calibration windows"):
        gptq_model(nn.Linear(4, 4), {}, [])


def _ctx(tmp_path: Path, windows: int = 2, length: int = 64) -> StageContext:
    g = torch.Generator().manual_seed(3)
    wins = [torch.randint(0, 1000, (length,), generator=g) for _ in range(windows)]
    return StageContext(tokenizer=None, calibration=wins, train_ids=torch.zeros(0, dtype=torch.long),
                        target=None, work_dir=tmp_path, log=lambda s: None)


def _stage(tiny_cfg, **opts):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", **opts}]
    return load_config(tiny_cfg).stages[0]


def test_gptq_stage_installs_torchao_tensors_that_compute_the_gptq_weights(tiny_llama, tiny_cfg, tmp_path):
    """The installed IntxUnpackedToInt8Tensor holds GPTQ's integers and scales exactly: the eager
    forward equals per-token int8 activations times the de-quantized GPTQ weight."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    ctx = _ctx(tmp_path)
    cfg = _stage(tiny_cfg, algorithm="gptq", int8_modules=["lm_head"], keep_high_precision=[])
    model = get_stage("ptq_int8").fn(tiny_llama, cfg, ctx)
    d = ctx.details
    assert d["algorithm"] == "gptq" and d["gptq"]["layers"] == 15 and d["gptq"]["output_error_reduction"] > 0
    assert d["precision_mix"] == {"fp32": 0, "8da8w": 1, "8da4w": 14} and d["int8_modules"] == ["lm_head"]
    head, down = model.lm_head.weight, model.model.layers[0].mlp.down_proj.weight
    assert isinstance(head, IntxUnpackedToInt8Tensor) and head.target_dtype == torch.int8
    assert isinstance(down, IntxUnpackedToInt8Tensor) and down.target_dtype == torch.int4
    assert list(down.block_size) == [1, 32] and int(down.qdata.min()) >= -8 and int(down.qdata.max()) <= 7
    x = torch.randn(5, down.shape[1])
    dq = (down.qdata.float().view(down.shape[0], -1, 32) * down.scale.float().view(down.shape[0], -1, 1)).view(down.shape)
    want = F.linear(qdq_act_per_token(x), dq)
    got = model.model.layers[0].mlp.down_proj(x)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_gptq_stage_in_bfloat16_keeps_its_integers(tiny_llama, tiny_cfg, tmp_path, monkeypatch):
    """compute_dtype bfloat16 (a 1B model on a GPU): building the torchao tensor from a bf16 weight
    and a bf16 scale moved integers off GPTQ's grid ("GPTQ integers changed"). The tensor is built
    in fp32, then only its scale takes the model's dtype."""
    from optimize.quant import gptq_sequential as gptq_mod

    seen = {}
    real = gptq_mod.gptq_model

    def keep(*a, **k):
        seen["res"] = real(*a, **k)
        return seen["res"]

    monkeypatch.setattr("optimize.stages.ptq_gptq.gptq_model", keep)  # where the stage calls it
    model = tiny_llama.to(torch.bfloat16)
    cfg = _stage(tiny_cfg, algorithm="gptq", int8_modules=["lm_head"], keep_high_precision=[])
    model = get_stage("ptq_int8").fn(model, cfg, _ctx(tmp_path))
    down = model.model.layers[0].mlp.down_proj.weight
    assert down.dtype == torch.bfloat16 and down.scale.dtype == torch.bfloat16
    assert torch.equal(down.qdata, seen["res"].layers["model.layers.0.mlp.down_proj"].q.to(down.qdata.device))
    logits = model(input_ids=torch.arange(16)[None]).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_gptq_stage_has_lower_kl_than_round_to_nearest(tiny_llama, tiny_cfg, tmp_path):
    """On the tiny model's own text, GPTQ's logits are closer to fp32 than RTN's."""
    import copy

    tiny_llama.eval()
    ids = _ctx(tmp_path, 7, 128).calibration[6].view(1, -1)  # not among the 6 windows GPTQ calibrates on
    with torch.no_grad():
        ref = F.log_softmax(tiny_llama(ids).logits, -1)
    kls = {}
    for algo in ("rtn", "gptq"):
        m = get_stage("ptq_int8").fn(copy.deepcopy(tiny_llama), _stage(tiny_cfg, algorithm=algo), _ctx(tmp_path, 6, 128))
        with torch.no_grad():
            out = F.log_softmax(m(ids).logits, -1)
        kls[algo] = float(F.kl_div(out, ref, log_target=True, reduction="batchmean"))
    assert kls["gptq"] < kls["rtn"], kls


@pytest.mark.parametrize(
    "opts,message",
    [
        ({"gptq": {"damp": 0.01}}, "gptq options apply only with algorithm: gptq"),
        ({"algorithm": "gptq", "weight_qparams": "hqq_scale_only"}, "gptq.scale_init: hqq"),
        ({"algorithm": "gptq", "gptq": {"damp": 1.5}}, r"stages\.0\.gptq\.damp"),
        ({"algorithm": "gptq", "gptq": {"scale_init": "minmax"}}, r"stages\.0\.gptq\.scale_init.*'mse'"),
        ({"algorithm": "gptq", "gptq": {"dampening": 0.1}}, r"stages\.0\.gptq\.dampening: unknown key"),
        ({"algorithm": "gptq", "gptq": {"calibration_windows": 0}}, "greater than or equal to 1"),
        ({"algorithm": "optimal"}, r"stages\.0\.algorithm.*'rtn'"),
    ],
)
def test_bad_gptq_options_name_the_path(tiny_cfg, opts, message):
    with pytest.raises(ConfigError, match=message):
        _stage(tiny_cfg, **opts)


def test_gptq_without_calibration_text_says_so(tiny_llama, tiny_cfg, tmp_path):
    ctx = StageContext(tokenizer=None, calibration=[], train_ids=torch.zeros(0, dtype=torch.long),
                       target=None, work_dir=tmp_path)
    with pytest.raises(ValueError, match="calibration_tokens"):
        get_stage("ptq_int8").fn(tiny_llama, _stage(tiny_cfg, algorithm="gptq"), ctx)


@pytest.mark.slow
def test_pipeline_ships_the_mix_and_the_report_shows_it(tiny_cfg):
    """A GPTQ stage with a hand-listed mix, exported to ExecuTorch: the report's precision section
    names the mix twice, from the stage and read back from the exported graph, and a rerun resumes
    the quantized stage from its checkpoint (custom-scale torchao tensors reload)."""
    from pathlib import Path

    from optimize import run_pipeline

    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "algorithm": "gptq",
                           "keep_high_precision": ["model.layers.0"], "int8_modules": ["lm_head"]}]
    tiny_cfg["target"] = "executorch"
    tiny_cfg["export"] = {"executorch": {"max_seq_len": 160}}
    tiny_cfg["checks"]["generate_tokens"] = 0
    cfg = load_config(tiny_cfg)
    report = run_pipeline(cfg, say=lambda m: None)
    assert report.ok, [r.error for r in report.rows]
    exported = report.row("export:executorch").details["quantization"]["exported_linear"]
    assert exported["counts"] == {"fp32": 7, "8da4w": 7, "8da8w": 1}
    md = (Path(report.output_dir) / "report.md").read_text()
    assert "## Precision of the Linear layers" in md
    assert "0:ptq_int8 (gptq): fp32 7 · 8da8w 1 · 8da4w 7; 8da8w: lm_head; fp32: model.layers.0." in md
    assert "export:executorch, read from the exported graph: fp32 7 · 8da4w 7 · 8da8w 1; 8da4w: model.layers.1." in md
    messages: list[str] = []
    again = run_pipeline(load_config(tiny_cfg), say=messages.append)
    assert any("resuming" in m for m in messages), messages
    assert again.row("export:executorch").details["quantization"]["exported_linear"] == exported


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")])]


def _perplexity(model: nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids.to(next(model.parameters()).device)).logits[0, :-1].float().cpu()
    return float(torch.exp(F.cross_entropy(logits, ids[0, 1:])))


def _gptq(model: nn.Module, windows: list[torch.Tensor], device: str | None, tmp_path) -> tuple[nn.Module, dict]:
    from optimize.stages.ptq_config import Ptq8Config

    ctx = StageContext(tokenizer=None, calibration=windows, train_ids=torch.zeros(0, dtype=torch.long), target=None,
                       work_dir=tmp_path, log=lambda s: None, device=torch.device(device) if device else None)
    cfg = Ptq8Config(scheme="8da4w", algorithm="gptq", keep_high_precision=[], int8_modules=["lm_head"])
    out = get_stage("ptq_int8").fn(model, cfg, ctx)
    return out, ctx.details


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "phi3", "gemma"])
def test_gptq_on_a_device_matches_the_cpu(model_type, device, tmp_path):
    """GPTQ with the model on ``device`` (as the pipeline places it), and with the model left on
    the CPU and one block at a time brought to ``device``, quantizes as on the CPU: held-out
    perplexity within 1% and nearly every integer the same (float noise in the Hessians flips a
    few roundings). The streamed model is on the CPU again afterwards."""
    import copy

    from tiny_families import family  # tests/optimize is on sys.path (its conftest)
    from torchao.quantization import IntxUnpackedToInt8Tensor

    base = family(model_type)
    g = torch.Generator().manual_seed(5)
    windows = [torch.randint(1, 500, (64,), generator=g) for _ in range(4)]
    held_out = torch.randint(1, 500, (1, 96), generator=g)
    on_cpu, cpu_details = _gptq(copy.deepcopy(base), windows, None, tmp_path)
    placed, placed_details = _gptq(copy.deepcopy(base).to(device), windows, device, tmp_path)
    streamed, _ = _gptq(copy.deepcopy(base), windows, device, tmp_path)
    assert all(p.device.type == "cpu" for p in streamed.parameters())
    assert all(p.device.type == torch.device(device).type for p in placed.parameters())
    placed = placed.cpu()
    ref = _perplexity(on_cpu, held_out)
    for name, model in (("placed", placed), ("streamed", streamed)):
        assert _perplexity(model, held_out) == pytest.approx(ref, rel=0.01), name
        same = total = 0
        for (n, a), b in zip(on_cpu.named_modules(), model.modules()):
            if isinstance(getattr(a, "weight", None), IntxUnpackedToInt8Tensor):
                same += int((a.weight.qdata == b.weight.qdata.cpu()).sum())
                total += a.weight.qdata.numel()
        assert total and same / total >= 0.98, (name, same / total)
    assert placed_details["gptq"]["layers"] == cpu_details["gptq"]["layers"] > 0
    err = cpu_details["gptq"]["mean_rel_output_error_gptq"]
    assert placed_details["gptq"]["mean_rel_output_error_gptq"] == pytest.approx(err, rel=0.05)
