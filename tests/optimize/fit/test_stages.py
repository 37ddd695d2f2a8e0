"""``optimize fit`` and the YAML's stages that do not quantize: the finalists are measured after the
ones a run already finished, and fit.yaml's run resumes from their linked checkpoints."""

from __future__ import annotations

import pytest
import yaml

from optimize.config import load_config
from optimize.fit import fit


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_finished_leading_stages_are_measured_after_and_linked_for_fit_yaml(tiny_cfg, tmp_path):
    """A run of the YAML finished its distill stage (a checkpoint written here, its weights changed so
    the difference shows): fit measures the recipes on that model, not the one as loaded, and
    hard-links the checkpoint into fit.yaml's own run directory, where that run's resume finds it."""
    import torch

    from optimize import checkpoints as ckpt
    from optimize.fit import stages as fit_stages
    from targets.sources import load_model

    tiny_cfg["stages"] = [{"kind": "distill"}, {"kind": "ptq_int8", "scheme": "8da4w"}]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    cfg = load_config(path, check_model=False)
    as_loaded = fit(path, "raspberry-pi-5", out_dir=tmp_path / "before", windows=1, finalists=1)
    assert as_loaded.quality["model"].startswith("the model as loaded") and as_loaded.reused_stages == []
    assert "have no finished checkpoint" in as_loaded.quality["model"]

    model = load_model(cfg.model).model
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)  # what a distillation might have done
    stage0 = fit_stages.stage_dirs(cfg, 1)[0]
    ckpt.save_stage(stage0, model, {"name": "stage0:distill", "status": "pass"}, {"kind": "distill"})
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "after", windows=1, finalists=1)
    assert res.quality["model"].startswith("the model after 0:distill") and str(stage0) in res.quality["model"]
    assert res.quality["baseline_perplexity"] != as_loaded.quality["baseline_perplexity"]
    fit_cfg = load_config(tmp_path / "after" / "fit.yaml", check_model=False)
    assert [s.kind for s in fit_cfg.stages] == ["distill"]
    linked = fit_stages.stage_dirs(fit_cfg, 1)[0]
    assert res.reused_stages == [str(linked)] and ckpt.is_complete(linked) and linked != stage0
    assert (linked / "model.pt").stat().st_ino == (stage0 / "model.pt").stat().st_ino  # a link, not a copy
    assert fit_stages.finished(fit_cfg) == [linked]  # what `optimize pipeline fit.yaml` resumes from
    again = fit(path, "raspberry-pi-5", out_dir=tmp_path / "after", windows=0)  # already there: left alone
    assert again.reused_stages == [] and ckpt.is_complete(linked)
