"""``optimize fit``: recipes priced from bytes (no export) against a device, the finalists' perplexity
measured on a short eval, a Pareto table, plot and the winning YAML; a refusal names the closest."""

from __future__ import annotations

import yaml

from optimize.cli import main
from optimize.config import load_config
import json

import pytest

from optimize.fit import FitRefused, fit
from device_files import device_file


def _device(tmp_path, **over) -> str:
    return device_file(tmp_path, **over)


def test_fit_prices_recipes_and_writes_the_winner(tiny_cfg, tmp_path):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w"}]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", windows=0)  # bytes only
    groups = {r.group_size for r in res.rows if r.scheme == "8da4w"}
    assert groups == {32, 64}  # 128 does not divide the tiny model's 64-wide inputs
    assert any(r.pareto for r in res.rows) and all(r.fits for r in res.rows)
    by = {r.label(): r for r in res.rows}
    fp32_head = by["8da8w, lm_head fp32, embedding fp32"]
    int8_all = by["8da8w, lm_head same, embedding int8"]
    assert int8_all.artifact_bytes < fp32_head.artifact_bytes and int8_all.decode_ceiling_tok_s > fp32_head.decode_ceiling_tok_s
    fp32 = by["fp32 (no quantization)"]
    assert fp32.artifact_bytes > fp32_head.artifact_bytes and fp32.quality_penalty == 0
    # the tiny Llama is tied: where the table and lm_head hold the same bytes (fp32/fp32, int8/8da8w),
    # weights: external stores the table once; an int4 table never shares
    table = tiny_cfg["model"]["config"]["vocab_size"] * tiny_cfg["model"]["config"]["hidden_size"]
    once = by["fp32 (no quantization), weights external (tied table once)"]
    assert fp32.artifact_bytes - once.artifact_bytes == 4 * table and once.quality_penalty == 0
    int8_once = by["8da8w, lm_head same, embedding int8, weights external (tied table once)"]
    hidden = tiny_cfg["model"]["config"]["hidden_size"]
    assert int8_all.artifact_bytes - int8_once.artifact_bytes == pytest.approx(table * (1 + 5 / hidden), rel=1e-3)
    assert int8_once.weight_bytes_per_token == int8_all.weight_bytes_per_token
    # storage, not memory: the lookup keeps its own copy (measured, tests/optimize/test_memory.py)
    assert int8_once.memory_bytes == int8_all.memory_bytes and once.memory_bytes == fp32.memory_bytes
    assert not [r for r in res.rows if r.weights == "external" and (r.embedding == "int4" or r.lm_head == "fp32"
                                                                      and r.embedding is not None)]
    # per layer type: int8 attention beside an int4 MLP sits between all-int8 and all-int4
    att, plain = by["8da4w g32, attention 8da8w, lm_head same, embedding int8"], by["8da4w g32, lm_head same, embedding int8"]
    assert int8_all.artifact_bytes > att.artifact_bytes > plain.artifact_bytes
    assert int8_all.quality_penalty < att.quality_penalty < plain.quality_penalty
    assert att.export_block()["attention"] == "8da8w" and "attention" not in plain.export_block()
    # everything fits, no decode budget, nothing measured: the least quantized, then the least memory
    assert res.winner is once
    written = (tmp_path / "fit" / "fit.yaml").read_text()
    assert "predicted decode ceiling" in written and "quantizing stages dropped" in written
    cfg = load_config(tmp_path / "fit" / "fit.yaml")
    assert cfg.stages == [] and cfg.device_profile == "raspberry-pi-5"
    assert cfg.name == f"{load_config(path).name}-fit-raspberry-pi-5"  # its own run directory
    assert str(cfg.output_dir) == tiny_cfg["output_dir"] + "-fit-raspberry-pi-5"
    assert cfg.export["executorch"] == {"quantize": "none", "lm_head": "same", "embedding_quantize": None,
                                        "weights": "external"}
    assert "decode ceiling tok/s (predicted)" in (tmp_path / "fit" / "fit.md").read_text()


def test_a_decode_budget_and_a_small_memory_choose_and_refuse(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    loose = fit(path, _device(tmp_path), out_dir=tmp_path / "a", windows=0)
    rates = sorted({r.decode_ceiling_tok_s for r in loose.rows})
    budget = rates[-2] + 1  # only the fastest recipes meet it
    res = fit(path, _device(tmp_path, budgets={"decode_tok_s": budget}), out_dir=tmp_path / "b", windows=0)
    assert res.winner is not None and res.winner.decode_ceiling_tok_s >= budget and res.winner.scheme == "8da4w"
    assert any("predicted ceiling" in r.why_not for r in res.rows)
    assert fit(path, _device(tmp_path), out_dir=tmp_path / "b2", windows=0, decode_tok_s=budget).winner.label() \
        == res.winner.label()  # the CLI's budget works as the profile's
    tiny = _device(tmp_path, memory={"total_gib": 1, "usable_gib": 0.001, "usable_basis": "test"})
    assert main(["fit", str(path), "--device-profile", tiny, "--output", str(tmp_path / "c"), "--windows", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no recipe fits tiny-board: the closest, ")
    assert "> usable 1 MiB" in err[0]
    rows = json.loads((tmp_path / "c" / "fit.json").read_text())["rows"]
    closest = min(rows, key=lambda r: r["miss"])
    assert closest["label"] in err[0] and closest["memory_bytes"] == min(r["memory_bytes"] for r in rows)


def test_finalists_are_measured_and_the_lowest_perplexity_wins(tiny_cfg, tmp_path):
    """The finalists' perplexity is the exporter's quantization measured on the eval split (the fp32
    row equals the baseline to 1e-6); the winner is the lowest measured one; the plot is drawn."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", windows=2, finalists=4)
    measured = [r for r in res.rows if r.measured]
    assert len({r.quant_key() for r in measured}) == 4 and res.quality["windows"] == 2
    # a recipe that differs from a finalist only in where its weights live shares its measurement
    twins = [r for r in measured if r.weights == "external"]
    assert twins and all(next(o for o in measured if o.weights == "embedded" and o.quant_key() == t.quant_key())
                         .perplexity == t.perplexity for t in twins)
    assert res.winner in measured and res.winner.perplexity == min(r.perplexity for r in measured)
    fp32 = next(r for r in measured if r.scheme == "none")  # penalty 0: the first finalist
    assert abs(fp32.perplexity - res.quality["baseline_perplexity"]) <= 1e-6 * fp32.perplexity
    assert all(r.perplexity_delta_pct > -50 for r in measured)
    assert (tmp_path / "fit" / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "MEASURED for the finalists" in (tmp_path / "fit" / "fit.md").read_text()
    assert "measured perplexity" in (tmp_path / "fit" / "fit.yaml").read_text()
    # a perplexity budget: the recipes above it do not fit, and say why
    top = max(r.perplexity_delta_pct for r in measured)
    if top > 0:
        res2 = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit2", windows=2, finalists=4, max_ppl_pct=top / 2)
        over = [r for r in res2.rows if r.measured and r.perplexity_delta_pct > top / 2]
        assert over and all(not r.fits and "perplexity" in r.why_not for r in over)
        assert res2.winner.perplexity_delta_pct <= top / 2


def test_every_finalist_over_the_perplexity_budget_is_a_refusal(tiny_cfg, tmp_path, monkeypatch):
    import optimize.fit.quality as fq

    def lossy(cfg, rows, **kw):
        for r in rows:
            r.perplexity, r.perplexity_delta_pct = 99.0, 12.0 + r.quality_penalty
        return {"baseline_perplexity": 88.0, "windows": 1, "tokens": 8}

    monkeypatch.setattr(fq, "measure_finalists", lossy)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**tiny_cfg, "gates": {"perplexity": {"max_pct_degradation": 8}}}))
    with pytest.raises(FitRefused, match=r"the closest, fp32 \(no quantization\), misses by "
                                         r"perplexity \+12\.00% > 8%") as err:
        fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", finalists=2)  # the YAML's gate is the budget
    assert err.value.result.winner is None and (tmp_path / "fit" / "fit.md").exists()


def test_the_api_is_quiet_and_the_log_keeps_the_measurement(tiny_cfg, tmp_path, capfd):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    capfd.readouterr()
    lines = []
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", windows=1, finalists=2, log=lines.append)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # no bars, no library warnings on the process's descriptors
    assert res.winner is not None and len(lines) == 3  # the baseline and one line per finalist
    assert "win" in (tmp_path / "fit" / "fit.log").read_text()  # the bars went to the log


@pytest.mark.parametrize("kw, message", [({"windows": -1}, "windows must be >= 0"),
                                         ({"finalists": 0}, "finalists >= 1"),
                                         ({"export_finalists": -1}, "export_finalists >= 0"),
                                         ({"export_finalists": 1, "windows": 0}, "export_finalists needs windows > 0"),
                                         ({"target": "onnxruntime"}, "target 'onnxruntime' is not priced")])
def test_bad_fit_arguments_are_refused(tiny_cfg, tmp_path, kw, message):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    with pytest.raises(ValueError, match=message):
        fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", **kw)


def test_a_shorter_cache_is_taken_only_when_nothing_fits_at_full_length(tiny_cfg, tmp_path, capsys):
    """``max_seq_lens``: every length is priced; the longest at which a recipe fits wins, so a shorter
    cache is how a tight budget is met, never a preference; fit.yaml carries the length it chose."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    both = fit(path, "raspberry-pi-5", out_dir=tmp_path / "a", windows=0, max_seq_lens=[64, 512])
    assert both.winner.max_seq_len == 512 and both.max_seq_lens == [512, 64]
    least = {n: min(r.memory_bytes for r in both.rows if r.max_seq_len == n) for n in (64, 512)}
    assert least[64] < least[512]
    budget_gib = (least[64] + least[512]) / 2 / 2**30
    assert main(["fit", str(path), "--device-profile", "raspberry-pi-5", "--output", str(tmp_path / "b"),
                 "--windows", "0", "--max-memory-gib", str(budget_gib), "--max-seq-len", "512", "64"]) == 0
    assert "max_seq_len 64 **winner**" in capsys.readouterr().out
    data = json.loads((tmp_path / "b" / "fit.json").read_text())
    assert data["winner"].endswith("max_seq_len 64") and data["max_seq_lens"] == [512, 64]
    assert all(not r["fits"] for r in data["rows"] if r["max_seq_len"] == 512)
    assert load_config(tmp_path / "b" / "fit.yaml").export["executorch"]["max_seq_len"] == 64
    # a length the exporter would refuse is refused before anything is priced
    limit = tiny_cfg["model"]["config"].get("max_position_embeddings", 2048)
    with pytest.raises(ValueError, match=rf"max_seq_len {4 * limit}: .*max_position_embeddings"):
        fit(path, "raspberry-pi-5", out_dir=tmp_path / "c", windows=0, max_seq_lens=[512, 4 * limit])


@pytest.mark.slow  # two tiny ExecuTorch exports (about 30 s)
def test_the_best_finalists_are_exported_and_measured_in_the_runtime(tiny_cfg, tmp_path):
    """--export-finalists: the best measured recipes are lowered as fit.yaml would lower them and
    measured in ExecuTorch (bytes as written, perplexity on the same windows, host decode, the device's
    decode PREDICTED from it); the winner is the exported one with the lowest runtime perplexity."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    lines = []
    res = fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit", windows=1, finalists=3, export_finalists=2,
              log=lines.append)
    exported = [r for r in res.rows if r.runtime is not None]
    assert len(exported) == 2 and len({r.quant_key() for r in exported}) == 2
    assert res.winner in exported
    assert res.winner.runtime["perplexity"] == min(r.runtime["perplexity"] for r in exported)
    for r in exported:
        rt = r.runtime
        assert (tmp_path / "fit" / "finalists").exists() and rt["artifact"].endswith("model.pte")
        # the priced bytes against the written ones (the tiny model's metadata methods are a larger share)
        assert rt["artifact_bytes"] == pytest.approx(r.artifact_bytes, rel=0.1), (rt, r.artifact_bytes)
        assert rt["host_decode_tok_s"] > 0 and rt["predicted_decode_tok_s"] > 0
        assert abs(rt["perplexity"] / r.perplexity - 1) < 0.1  # XNNPACK's kernels against torchao's reference
    assert sum("fit: exported" in m for m in lines) == 2
    # the third finalist was not exported: its decode is PREDICTED from the exported recipe whose bytes
    # are read at the most alike precisions, with that recipe's measured fraction of the ceiling
    from optimize.footprint.predict import DevicePrediction, precision_overlap

    def mix(weights):
        return DevicePrediction(device="d", kind="host", usable_memory_bytes=1, storage_bytes=1,
                                device_bandwidth_gb_s=1.0, weight_bytes_by_scheme=weights)

    for r in exported:  # the priced split against the exported graph's record: the same schemes; the
        # record counts 4 bytes of scale per group of 32, the price 5 per group at the recipe's size
        assert r.runtime["weight_bytes_by_scheme"].keys() == r.weight_bytes_by_scheme.keys()
        for k, v in r.weight_bytes_by_scheme.items():
            assert r.runtime["weight_bytes_by_scheme"][k] == pytest.approx(v, rel=0.06), k
    other = [r for r in res.rows if r.measured and r.runtime is None and r.fits]
    assert other and all(r.predicted_decode for r in other)
    for r in other:
        pd = r.predicted_decode
        src = next(e for e in exported if e.label() == pd["source"])
        assert pd["host_fraction_of_ceiling"] == src.runtime["host_fraction_of_ceiling"]
        overlaps = [precision_overlap(mix(e.runtime["weight_bytes_by_scheme"]), mix(r.weight_bytes_by_scheme))
                    for e in exported]
        assert pd["precision_overlap"] == max(overlaps)
        assert pd["predicted_decode_tok_s"] > 0 and pd["host_decode_tok_s"] > 0
    assert "ExecuTorch perplexity" in (tmp_path / "fit" / "fit.md").read_text()
    assert "PREDICTED from" in (tmp_path / "fit" / "fit.md").read_text()
    assert "exported:" in (tmp_path / "fit" / "fit.yaml").read_text()
    with pytest.raises(ValueError, match="export_finalists needs windows > 0"):
        fit(path, "raspberry-pi-5", out_dir=tmp_path / "fit2", windows=0, export_finalists=1)
