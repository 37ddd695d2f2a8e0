"""``optimize fit --depths``: depth pruning with healing as a search dimension. Each depth is priced
from its pruned config; where it is a finalist it is pruned and healed as the pipeline runs those
stages, its quantizations are measured against the unpruned baseline, and a depth that wins puts its
stages first in fit.yaml, whose run resumes from the healed checkpoints."""

from __future__ import annotations

import pytest
import yaml

from optimize.cli import main
from optimize.config import load_config
from optimize.fit import fit
from device_files import device_file


def _yaml(tmp_path, cfg, name="p.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "gemma"])
def test_each_depth_is_priced_from_its_pruned_config(tiny_cfg, tiny_config, tmp_path, family):
    """Bytes only: a recipe at fewer blocks reads fewer weight and KV bytes per token, in proportion
    to the blocks dropped (the table and head are unchanged), and costs more heuristic quality."""
    tiny_cfg["model"]["config"] = tiny_config(family, num_hidden_layers=4)
    res = fit(_yaml(tmp_path, tiny_cfg), "raspberry-pi-5", out_dir=tmp_path / "fit", windows=0, depths=[2, 3])
    assert res.depths == [3, 2] and res.heal_steps == 32
    full = {r.label(): r for r in res.rows if r.depth is None}
    for depth in (3, 2):
        rows = [r for r in res.rows if r.depth == depth]
        assert len(rows) == len(full)
        for r in rows:
            twin = full[r.label().removeprefix(f"{depth} blocks (depth-pruned), ")]
            assert r.kv_cache_bytes * 4 == twin.kv_cache_bytes * depth  # the cache per block
            assert r.weight_bytes_per_token < twin.weight_bytes_per_token
            assert r.decode_ceiling_tok_s > twin.decode_ceiling_tok_s
            assert r.quality_penalty > twin.quality_penalty and r.quant_key() != twin.quant_key()
    blocks_dropped = {d: next(r for r in res.rows if r.depth == d and r.scheme == "none") for d in (3, 2)}
    fp32 = full["fp32 (no quantization)"]
    per_block = fp32.weight_bytes_per_token - blocks_dropped[3].weight_bytes_per_token
    assert fp32.weight_bytes_per_token - blocks_dropped[2].weight_bytes_per_token == 2 * per_block
    assert res.winner.depth is None  # nothing asks for speed: the full depth's least loss wins


@pytest.mark.parametrize("kw, message", [
    ({"depths": [4]}, "keeps every one of the model's 4 blocks"),
    ({"depths": [0]}, "must be >= 1"),
    ({"depths": [2], "heal_steps": -1}, "heal_steps must be >= 0"),
])
def test_a_depth_the_prune_stage_would_refuse_is_refused_before_pricing(tiny_cfg, tiny_config, tmp_path, kw, message):
    tiny_cfg["model"]["config"] = tiny_config("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match=message):
        fit(_yaml(tmp_path, tiny_cfg), "raspberry-pi-5", out_dir=tmp_path / "fit", windows=0, **kw)
    assert not (tmp_path / "fit").exists()


def test_a_yaml_that_already_prunes_depth_is_refused_in_one_line(tiny_cfg, tiny_config, tmp_path, capsys):
    tiny_cfg["model"]["config"] = tiny_config("llama", num_hidden_layers=4)
    tiny_cfg["stages"] = [{"kind": "prune", "method": "depth", "num_hidden_layers": 3}]
    path = _yaml(tmp_path, tiny_cfg)
    assert main(["fit", str(path), "--device-profile", "raspberry-pi-5", "--output", str(tmp_path / "fit"),
                 "--windows", "0", "--depths", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already prunes depth (0:prune)" in err[0]


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_a_depth_wins_when_only_it_meets_the_decode_budget(tiny_cfg, tiny_config, tmp_path):
    """A decode floor between the full depth's fastest ceiling and the pruned one's: only 3-block
    recipes fit, so that depth is pruned and healed (a pipeline run, no export), its quantizations
    measured against the unpruned model, and fit.yaml starts with its prune and distill stages, whose
    checkpoints are linked so `optimize pipeline fit.yaml` resumes after them. A re-run of fit reuses
    the heal."""
    from optimize import checkpoints as ckpt
    from optimize.fit import stages as fit_stages

    tiny_cfg["model"]["config"] = tiny_config("llama", num_hidden_layers=4)
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da8w"}]
    path = _yaml(tmp_path, tiny_cfg)
    priced = fit(path, "raspberry-pi-5", out_dir=tmp_path / "priced", windows=0, depths=[3])
    fastest_full = max(r.decode_ceiling_tok_s for r in priced.rows if r.depth is None)
    budget = fastest_full * 1.01
    assert any(r.depth == 3 and r.decode_ceiling_tok_s >= budget for r in priced.rows)
    board = device_file(tmp_path, budgets={"decode_tok_s": budget})
    res = fit(path, board, out_dir=tmp_path / "fit", windows=2, finalists=2, depths=[3], heal_steps=2)
    assert res.winner is not None and res.winner.depth == 3 and res.winner.measured
    assert all(not r.fits and "predicted ceiling" in r.why_not for r in res.rows if r.depth is None)
    healed = res.quality["depths"][3]
    assert healed["stages"][0].startswith("00-prune-") and healed["stages"][1].startswith("01-distill-")
    # the changes are against the unpruned model's fp32 perplexity, not the healed one's
    assert res.quality["baseline_perplexity"] == res.quality["model_perplexity"]
    assert healed["fp32_perplexity"] != res.quality["baseline_perplexity"]  # a different (pruned) model
    measured = [r for r in res.rows if r.depth == 3 and r.measured]
    assert len({r.quant_key() for r in measured}) == 2
    for r in measured:
        assert r.perplexity_delta_pct == pytest.approx(100 * (r.perplexity / res.quality["baseline_perplexity"] - 1),
                                                       abs=2e-3)
    text = (tmp_path / "fit" / "fit.yaml").read_text()
    assert "depth 3 of 4 blocks" in text and "2-step distillation heal" in text
    fit_cfg = load_config(tmp_path / "fit" / "fit.yaml")
    assert [s.kind for s in fit_cfg.stages] == ["prune", "distill"]
    assert fit_cfg.stages[0].num_hidden_layers == 3 and fit_cfg.stages[1].steps == 2
    assert len(res.reused_stages) == 2 and fit_stages.finished(fit_cfg) == [
        ckpt.stage_dir(fit_cfg.run_dir(), i, k, p.split("-")[-1]) for i, (k, p) in
        enumerate(zip(("prune", "distill"), healed["stages"]))]
    assert "depth-pruned recipes measured on the healed model" in (tmp_path / "fit" / "fit.md").read_text()
    again = fit(path, board, out_dir=tmp_path / "fit", windows=2, finalists=2, depths=[3], heal_steps=2)
    assert again.winner.label() == res.winner.label() and again.winner.perplexity == res.winner.perplexity
    log = (tmp_path / "fit" / "depth" / "3" / "pipeline.log").read_text()
    assert "resuming: all 2 stages finished in an earlier run" in log


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_heal_steps_0_prunes_without_a_heal(tiny_cfg, tiny_config, tmp_path):
    """--heal-steps 0: the depth's run and fit.yaml have the prune stage alone, and say so."""
    tiny_cfg["model"]["config"] = tiny_config("mistral", num_hidden_layers=4)
    path = _yaml(tmp_path, tiny_cfg)
    priced = fit(path, "raspberry-pi-5", out_dir=tmp_path / "priced", windows=0, depths=[3])
    floor = 1.01 * max(r.decode_ceiling_tok_s for r in priced.rows if r.depth is None)
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", windows=1, finalists=1, depths=[3], heal_steps=0,
              decode_tok_s=floor)
    assert res.winner.depth == 3 and [p.split("-")[1] for p in res.quality["depths"][3]["stages"]] == ["prune"]
    assert [s.kind for s in load_config(tmp_path / "fit" / "fit.yaml").stages] == ["prune"]
    assert "no heal (--heal-steps 0)" in (tmp_path / "fit" / "fit.yaml").read_text()
    assert "3 blocks: fp32" in (tmp_path / "fit" / "fit.md").read_text() and "not healed" in (
        tmp_path / "fit" / "fit.md").read_text()


@pytest.mark.slow
@pytest.mark.minutes(1.2)
def test_fit_yaml_of_a_depth_winner_resumes_after_the_heal_and_exports(tiny_cfg, tiny_config, tmp_path):
    """`optimize pipeline fit.yaml` on a depth winner: the prune and heal rows are resumed (with the
    figures fit's run measured), not trained again, and the pruned model exports to a smaller .pte;
    --export-finalists exports the depth's recipe from the healed model."""
    from optimize.pipeline import run_pipeline

    tiny_cfg["model"]["config"] = tiny_config("qwen2", num_hidden_layers=4)
    tiny_cfg["checks"]["memory"] = True  # fit.yaml names the device: its memory gate needs the measured peak
    path = _yaml(tmp_path, tiny_cfg)
    priced = fit(path, "raspberry-pi-5", out_dir=tmp_path / "priced", windows=0, depths=[2])
    # a memory budget only 2-block recipes meet (the tiny model's decode, predicted from its measured
    # rate, is overhead-bound: a decode floor would hold the exported recipe to a figure it cannot reach)
    gib = 0.99 * min(r.memory_bytes for r in priced.rows if r.depth is None) / 2**30
    assert any(r.memory_bytes < gib * 2**30 for r in priced.rows if r.depth == 2)
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", windows=1, finalists=1, depths=[2], heal_steps=1,
              max_memory_gib=gib, export_finalists=1)
    assert res.winner.depth == 2
    # --export-finalists exports a depth's recipe from its healed model
    assert res.winner.runtime is not None
    assert res.winner.runtime["artifact"].startswith(str(tmp_path / "fit" / "depth" / "2" / "finalists"))
    assert res.winner.runtime["artifact_bytes"] == pytest.approx(res.winner.artifact_bytes, rel=0.15)  # priced
    report = run_pipeline(tmp_path / "fit" / "fit.yaml")
    assert report.ok, [(r.name, r.status, r.error, [g.message for g in r.gates if not g.ok]) for r in report.rows]
    names = [r.name for r in report.rows]
    assert names[:3] == ["baseline", "0:prune", "1:distill"] and names[3].startswith("export:")
    assert [r.status for r in report.rows[1:3]] == ["resumed", "resumed"]
    assert report.rows[2].metrics.perplexity == pytest.approx(res.quality["depths"][2]["perplexity"]["1:distill"])
    assert report.rows[3].metrics.size_mb < report.rows[0].metrics.size_mb
