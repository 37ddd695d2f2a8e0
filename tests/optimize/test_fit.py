"""``optimize fit``: recipes priced from bytes (no export) against a device, a Pareto table and the
winning YAML."""

from __future__ import annotations

import yaml

from optimize.cli import main
from optimize.config import load_config
from optimize.fit import fit
from targets.devices import DEVICE_DIR


def _device(tmp_path, **over) -> str:
    data = yaml.safe_load((DEVICE_DIR / "raspberry-pi-5.yaml").read_text())
    data.update(name="tiny-board", **over)
    path = tmp_path / "board.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_fit_prices_recipes_and_writes_the_winner(tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w"}]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit")
    groups = {r.group_size for r in res.rows if r.scheme == "8da4w"}
    assert groups == {32, 64}  # 128 does not divide the tiny model's 64-wide inputs
    assert any(r.pareto for r in res.rows) and all(r.fits for r in res.rows)
    by = {r.label(): r for r in res.rows}
    fp32_head = by["8da8w, lm_head fp32, embedding fp32"]
    int8_all = by["8da8w, lm_head same, embedding int8"]
    assert int8_all.artifact_bytes < fp32_head.artifact_bytes and int8_all.decode_ceiling_tok_s > fp32_head.decode_ceiling_tok_s
    assert res.winner is fp32_head  # everything fits and there is no decode budget: the least quantized
    written = (tmp_path / "fit" / "fit.yaml").read_text()
    assert "predicted decode ceiling" in written and "quantizing stages dropped" in written
    cfg = load_config(tmp_path / "fit" / "fit.yaml")
    assert cfg.stages == [] and cfg.device_profile == "raspberry-pi-5"
    assert cfg.export["executorch"] == {"quantize": "8da8w", "lm_head": "fp32", "embedding_quantize": None}
    assert "decode ceiling tok/s (predicted)" in (tmp_path / "fit" / "fit.md").read_text()


def test_a_decode_budget_and_a_small_memory_choose_and_refuse(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    loose = fit(path, _device(tmp_path), out_dir=tmp_path / "a")
    rates = sorted({r.decode_ceiling_tok_s for r in loose.rows})
    budget = rates[-2] + 1  # only the fastest recipes meet it
    res = fit(path, _device(tmp_path, budgets={"decode_tok_s": budget}), out_dir=tmp_path / "b")
    assert res.winner is not None and res.winner.decode_ceiling_tok_s >= budget and res.winner.scheme == "8da4w"
    assert any("predicted ceiling" in r.why_not for r in res.rows)
    tiny = _device(tmp_path, memory={"total_gib": 1, "usable_gib": 0.001, "usable_basis": "test"})
    assert main(["fit", str(path), "--device-profile", tiny, "--output", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "no recipe fits tiny-board" in out and "> usable 1 MiB" in out
