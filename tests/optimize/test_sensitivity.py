"""Sensitivity analysis: ranks a deliberately broken layer first, writes json/md/png."""

from __future__ import annotations

import json

import pytest
import torch

from optimize.quant.sensitivity import SensitivityReport, analyze_sensitivity, module_groups, write_sensitivity
from optimize.sensitivity import run_sensitivity


def _windows(n=2, length=48):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 1000, (length,), generator=g) for _ in range(n)]


def _break(model, name="model.layers.1.mlp.down_proj"):
    """Large +-1 weights with one 15x outlier per 32-group: the int4 step becomes 2, every other
    weight sits exactly half a step from zero and rounds to 0, so the layer's output is lost."""
    with torch.no_grad():
        w = model.get_submodule(name).weight
        w.copy_(torch.sign(torch.randn_like(w)))
        w[:, ::32] *= 15.0


def test_broken_layer_ranks_first(tiny_llama):
    _break(tiny_llama)
    ids = torch.randint(0, 1000, (1, 16))
    before = tiny_llama(ids).logits
    rep = analyze_sensitivity(tiny_llama, _windows(), "8da4w", ["blocks", "projections", "lm_head", "embeddings"])
    assert rep.entries[0].name in ("model.layers.1", "*.down_proj")
    assert {rep.entries[0].name, rep.entries[1].name} == {"model.layers.1", "*.down_proj"}
    assert rep.entries[1].kl > 5 * rep.entries[2].kl
    assert [e.kl for e in rep.entries] == sorted((e.kl for e in rep.entries), reverse=True)
    assert torch.equal(tiny_llama(ids).logits, before)  # the model is restored
    mods = rep.ranked_modules(["modules"])
    assert mods == []


def test_single_modules_and_report_files(tiny_llama, tmp_path):
    _break(tiny_llama, "model.layers.0.self_attn.o_proj")
    rep = analyze_sensitivity(tiny_llama, _windows(1), "8da4w", ["modules"])
    assert rep.entries[0].name == "model.layers.0.self_attn.o_proj"
    paths = write_sensitivity(rep, tmp_path / "sens")
    again = SensitivityReport.model_validate(json.loads(paths["json"].read_text()))
    assert again == rep
    assert "| 1 | model.layers.0.self_attn.o_proj |" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert "fake-quant" in rep.method


def test_groups_cover_blocks_projections_head_embeddings(tiny_llama):
    g = {label: (kind, names) for label, kind, names in module_groups(tiny_llama)}
    assert g["model.layers.0"][0] == "blocks" and len(g["model.layers.0"][1]) == 7
    assert g["*.down_proj"][1] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert g["lm_head"][0] == "lm_head" and g["model.embed_tokens"][0] == "embeddings"


def test_run_sensitivity_from_pipeline_config(tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da8w"}]
    rep = run_sensitivity(tiny_cfg, ["data.eval_tokens=64"], groups=["blocks"], windows=1, seq_len=32,
                          out_dir=tmp_path / "s")
    assert rep.scheme == "8da8w" and rep.windows == 1 and rep.tokens == 31
    assert (tmp_path / "s" / "sensitivity.md").exists()


def test_bad_values_say_what_is_wrong(tiny_llama):
    with pytest.raises(ValueError, match="unknown sensitivity group kind"):
        module_groups(tiny_llama, ["layers"])
    with pytest.raises(ValueError, match="at least one calibration window"):
        analyze_sensitivity(tiny_llama, [], "8da4w")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        analyze_sensitivity(tiny_llama, _windows(1), "int3")
    with pytest.raises(ValueError, match="group_size=48 does not divide"):
        analyze_sensitivity(tiny_llama, _windows(1), "8da4w", ["blocks"], group_size=48)
    with pytest.raises(ValueError, match="windows=0 must be >= 1"):
        run_sensitivity({}, windows=0)


def _inject_activation_outlier(model, layer=1, channel=5, factor=300.0):
    """Scale one up_proj output channel by ``factor`` and the down_proj column that reads it by
    1/factor: the fp32 model is unchanged, but down_proj's input gets a huge outlier channel."""
    mlp = model.model.layers[layer].mlp
    with torch.no_grad():
        mlp.up_proj.weight[channel] *= factor
        mlp.down_proj.weight[:, channel] /= factor


@pytest.mark.parametrize("scheme", ["w8a8-tensor", "8da8w"])
def test_activation_outliers_rank_their_reader_first(tiny_llama, scheme):
    """An outlier channel (exact in fp32) wrecks int8 activations of the one layer reading it; the
    ranking puts that layer first, and SmoothQuant's down fold takes most of its loss away."""
    from optimize.quant.smoothquant import smooth

    tiny_llama.eval()
    ids = torch.randint(0, 1000, (1, 24))
    with torch.no_grad():
        ref = tiny_llama(ids).logits
        _inject_activation_outlier(tiny_llama)
        assert (tiny_llama(ids).logits - ref).abs().max() < 1e-3
    rep = analyze_sensitivity(tiny_llama, _windows(), scheme, ["modules"])
    assert rep.entries[0].name == "model.layers.1.mlp.down_proj", [(e.name, e.kl) for e in rep.entries[:3]]
    assert rep.entries[0].kl > 3 * rep.entries[1].kl
    before = rep.entries[0].kl
    smooth(tiny_llama, _windows(), alpha=0.5, folds=("down",))
    after = analyze_sensitivity(tiny_llama, _windows(), scheme, custom=[("down", ["model.layers.1.mlp.down_proj"])])
    assert after.entries[0].kl < 0.5 * before, (after.entries[0].kl, before)


def test_run_sensitivity_takes_the_onnx_runtime_mode(tiny_cfg, tmp_path):
    tiny_cfg["target"] = "onnxruntime"
    for mode, scheme in (("dynamic", "w8a8-tensor"), ("dynamic_per_token", "8da8w")):
        tiny_cfg["export"] = {"onnxruntime": {"quantize": mode}}
        rep = run_sensitivity(tiny_cfg, ["data.eval_tokens=64"], groups=["blocks"], windows=1, seq_len=32,
                              out_dir=tmp_path / mode)
        assert rep.scheme == scheme


def test_cli_groups_take_one_comma_separated_value_and_keep_trailing_overrides():
    from optimize.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["sensitivity", "p.yaml", "--groups", "blocks,lm_head", "data.eval_tokens=64"])
    assert args.groups == ["blocks", "lm_head"]
    assert args.overrides == ["data.eval_tokens=64"]
    with pytest.raises(SystemExit):
        parser.parse_args(["sensitivity", "p.yaml", "--groups", "blocks,layers"])
