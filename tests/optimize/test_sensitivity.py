"""Sensitivity analysis: ranks a deliberately broken layer first, writes json/md/png."""

from __future__ import annotations

import json

import pytest
import torch

from optimize.sensitivity import SensitivityReport, analyze_sensitivity, module_groups, run_sensitivity, write_sensitivity


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
