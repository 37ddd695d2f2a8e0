"""stage_cache: a run in another directory reuses the stages an earlier run computed on the very
same weights, data and code, with every row unchanged; anything that changes the model after a
stage is another key; a run with other checks measures the reused model again; two runs started
together compute a shared stage once; a damaged entry is a miss; the cache stays bounded."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from optimize import load_config, run_pipeline
from optimize import stage_cache


@pytest.fixture()
def cache(private_cache, monkeypatch):
    monkeypatch.setattr(stage_cache, "MIN_STAGE_S", 0.0)  # the tiny stages take milliseconds
    return private_cache / "stages"


def _cfg(tiny_cfg, tmp_path, run: str, stages=None, **top) -> dict:
    cfg = copy.deepcopy(tiny_cfg)
    cfg["output_dir"] = str(tmp_path / run)
    cfg["stages"] = stages or [{"kind": "test_noise", "scale": 0.02}, {"kind": "ptq_int8", "scheme": "8da8w"}]
    cfg["checks"] = {"latency": {"enabled": False}, "generate_tokens": 0}
    cfg["stage_cache"] = True
    return cfg | top


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")) if cache.is_dir() else []


def _spy_stages(monkeypatch) -> list[str]:
    from optimize import stage_api

    calls: list[str] = []
    real = stage_api.get_stage

    def spy(kind):
        spec = real(kind)
        return spec.__class__(**{**spec.__dict__, "fn": lambda m, c, x, _f=spec.fn: calls.append(kind) or _f(m, c, x)})

    monkeypatch.setattr("optimize.stage_rows.get_stage", spy)
    return calls


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_another_directory_reuses_every_stage_and_every_row(tiny_cfg, tmp_path, cache, monkeypatch):
    first = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "a")), say=lambda m: None)
    assert first.ok and len(_entries(cache)) == 2
    calls = _spy_stages(monkeypatch)
    said: list[str] = []
    second = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "b", name="other-name")), say=said.append)
    assert second.ok and calls == [], calls  # neither stage ran again
    assert [r.status for r in second.rows[1:]] == ["resumed", "resumed"]
    assert all("stage cache" in r.details["stage_cache"] for r in second.rows[1:])
    for a, b in zip(first.rows, second.rows):
        for metric in ("perplexity", "top1_agreement", "kl_divergence", "perplexity_delta_pct", "size_mb"):
            assert getattr(a.metrics, metric) == getattr(b.metrics, metric), (a.name, metric)
    assert sum("reused from the stage cache" in m for m in said) == 2
    # the run's checkpoint is a link to the entry (no second copy of the model's bytes)
    ckpt = Path(second.rows[-1].artifact) / "model.pt"
    assert ckpt.stat().st_nlink >= 2
    # and it resumes and exports like any checkpoint of its own
    third = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "b", name="other-name")), say=lambda m: None)
    assert third.ok and [r.status for r in third.rows[1:]] == ["resumed", "resumed"]


def test_a_changed_later_stage_reuses_the_prefix_only(tiny_cfg, tmp_path, cache, monkeypatch):
    run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "a")), say=lambda m: None)
    calls = _spy_stages(monkeypatch)
    other = [{"kind": "test_noise", "scale": 0.02}, {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32}]
    report = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "b", stages=other)), say=lambda m: None)
    assert report.ok and calls == ["ptq_int8"], calls
    assert report.rows[1].status == "resumed" and report.rows[2].status == "pass"


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_anything_that_changes_the_model_is_another_key(tiny_cfg, tmp_path, cache, monkeypatch):
    monkeypatch.setattr(stage_cache, "KEEP", 8)  # six keys must all stay to be counted (the bound has its own test)
    stages = [{"kind": "test_noise", "scale": 0.02}]
    run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "a", stages=stages)), say=lambda m: None)
    calls = _spy_stages(monkeypatch)
    for k, change in enumerate(["weights", "calibration", "seed", "stage_option", "target"]):
        cfg = _cfg(tiny_cfg, tmp_path, change, stages=copy.deepcopy(stages))
        if change == "weights":
            cfg["model"]["config"]["initializer_range"] = 0.03
        elif change == "calibration":
            cfg["data"]["calibration_tokens"] = 256
        elif change == "seed":
            cfg["seed"] = 1
        elif change == "stage_option":
            cfg["stages"][0]["scale"] = 0.03
        else:
            cfg["target"] = "onnxruntime"
            monkeypatch.setattr("optimize.pipeline.export_rows", lambda *a, **k: None)
        run_pipeline(load_config(cfg), say=lambda m: None)
        assert calls == ["test_noise"] * (k + 1), change
    assert len(_entries(cache)) == 6


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_names_and_gates_are_not_part_of_the_key_and_a_reused_row_meets_this_runs_gates(tiny_cfg, tmp_path, cache,
                                                                                        monkeypatch):
    stages = [{"kind": "test_noise", "scale": 0.05}]
    first = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "a", stages=stages)), say=lambda m: None)
    delta = first.rows[1].metrics.perplexity_delta_pct
    assert first.ok and delta > 0.1
    calls = _spy_stages(monkeypatch)
    lenient = [dict(stages[0], name="renamed", gates={"perplexity": {"max_pct_degradation": 10 * delta}})]
    report = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "b", stages=lenient)), say=lambda m: None)
    assert report.ok and calls == [] and report.rows[1].name == "renamed"
    strict = _cfg(tiny_cfg, tmp_path, "c", stages=stages, gates={"perplexity": {"max_pct_degradation": delta / 2}})
    report = run_pipeline(load_config(strict), say=lambda m: None)
    assert calls == [] and not report.ok  # reused, and stopped by this run's gate
    assert report.stopped_at == report.rows[1].name and report.rows[1].status == "fail"


def test_other_checks_measure_the_reused_model_again(tiny_cfg, tmp_path, cache, monkeypatch):
    from optimize import measure

    stages = [{"kind": "test_noise", "scale": 0.02}]
    first = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "a", stages=stages)), say=lambda m: None)
    calls = _spy_stages(monkeypatch)
    evals = []
    real = measure.evaluate
    monkeypatch.setattr(measure, "evaluate", lambda *a, **k: evals.append(k.get("desc")) or real(*a, **k))
    cfg = _cfg(tiny_cfg, tmp_path, "b", stages=stages)
    cfg["checks"]["generate_tokens"] = 4  # another checks block: the row is measured, the stage is not run
    report = run_pipeline(load_config(cfg), say=lambda m: None)
    assert report.ok and calls == [] and evals == ["baseline", "eval"], (calls, evals)
    assert "measured again" in report.rows[1].details["stage_cache"]
    assert report.rows[1].metrics.perplexity == pytest.approx(first.rows[1].metrics.perplexity, rel=1e-6)
    # the cache entry still holds the row as first measured (the run replaced its links, never wrote through)
    (entry,) = _entries(cache)
    assert stage_cache.measured_with(entry) != stage_cache.measured_with(Path(report.rows[1].artifact))


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_a_damaged_entry_is_a_miss(tiny_cfg, tmp_path, cache, monkeypatch):
    stages = [{"kind": "test_noise", "scale": 0.02}]
    run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "a", stages=stages)), say=lambda m: None)
    calls = _spy_stages(monkeypatch)
    for k, damage in enumerate(["row.json", "model.pt"]):
        (entry,) = _entries(cache)
        (entry / damage).unlink()  # the run's own checkpoint is a link to the same bytes: replace, never write through
        (entry / damage).write_bytes(b"{not json, not a zip")
        report = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, damage, stages=stages)), say=lambda m: None)
        assert report.ok and calls == ["test_noise"] * (k + 1), damage
        assert report.rows[1].status == "pass"


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_off_by_default_short_stages_are_not_kept_and_the_cache_is_bounded(tiny_cfg, tmp_path, private_cache,
                                                                            monkeypatch):
    cache = private_cache / "stages"
    cfg = _cfg(tiny_cfg, tmp_path, "off", stages=[{"kind": "test_noise", "scale": 0.02}])
    del cfg["stage_cache"]
    assert run_pipeline(load_config(cfg), say=lambda m: None).ok and not _entries(cache)
    # on, but the stage took less than MIN_STAGE_S: not worth a model's bytes on disk
    assert run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "short", stages=[{"kind": "test_noise"}])),
                        say=lambda m: None).ok
    assert not _entries(cache)
    monkeypatch.setattr(stage_cache, "MIN_STAGE_S", 0.0)
    monkeypatch.setattr(stage_cache, "KEEP", 2)
    for k in range(3):
        stages = [{"kind": "test_noise", "scale": 0.01 * (k + 1)}]
        assert run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, f"r{k}", stages=stages)), say=lambda m: None).ok
    assert len(_entries(cache)) == 2


_CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[3])
    import stage_plugins  # noqa: F401  (registers test_sleep, test_noise)
    from optimize import load_config, run_pipeline, stage_cache
    stage_cache.MIN_STAGE_S = 0.0
    report = run_pipeline(load_config(json.loads(open(sys.argv[1]).read())))
    ran = [r.name for r in report.rows[1:] if r.status == "pass"]
    open(sys.argv[2], "w").write(json.dumps({"ok": report.ok, "ran": ran}))
""")


@pytest.mark.slow  # two fresh interpreters
def test_two_runs_started_together_compute_a_shared_stage_once(tiny_cfg, tmp_path, cache):
    """The second process waits for the first's stage, then reuses it (fresh interpreters: a test never forks its worker)."""
    stages = [{"kind": "test_sleep", "seconds": 3.0}, {"kind": "test_noise", "scale": 0.02}]
    procs = []
    for name in ("p", "q"):
        cfg_file = tmp_path / f"{name}.json"
        cfg_file.write_text(json.dumps(_cfg(tiny_cfg, tmp_path, name, stages=stages)))
        procs.append(subprocess.Popen([sys.executable, "-c", _CHILD, str(cfg_file), str(tmp_path / f"{name}.out"),
                                       str(Path(__file__).parent)]))
    for p in procs:
        assert p.wait(timeout=300) == 0
    outs = [json.loads((tmp_path / f"{n}.out").read_text()) for n in ("p", "q")]
    assert all(o["ok"] for o in outs), outs
    assert sorted(len(o["ran"]) for o in outs) == [0, 2], outs  # one computed both stages, the other none


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_a_recipe_that_differs_in_its_head_reuses_awq_and_gptqs_blocks(tiny_cfg, tmp_path, cache, monkeypatch):
    """The main job (AWQ, then GPTQ with an int8 head) and an all-4-bit recipe with a tied int4 head:
    the second reuses the AWQ stage and GPTQ's decoder blocks, and solves only its head; its model is
    the one it computes alone (every integer equal), so its row is too."""
    from torchao.utils import TorchAOBaseTensor

    awq = {"kind": "awq", "scheme": "8da4w", "keep_high_precision": [], "calibration_windows": 1}
    ptq = {"kind": "ptq_int8", "scheme": "8da4w", "group_size": 32, "algorithm": "gptq", "keep_high_precision": []}
    main = [awq, ptq | {"int8_modules": ["lm_head"]}]
    all4 = [awq, ptq | {"quantize_embedding": "tied"}]
    assert run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "main", stages=main)), say=lambda m: None).ok
    calls = _spy_stages(monkeypatch)
    said: list[str] = []
    shared = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "all4", stages=all4)), say=said.append)
    assert shared.ok and calls == ["ptq_int8"], calls
    assert shared.rows[1].status == "resumed" and shared.rows[2].details["gptq_timing"]["blocks_cache"] == "reused"
    assert any("decoder-block layers reused" in m for m in said)
    alone_cfg = _cfg(tiny_cfg, tmp_path, "alone", stages=all4)
    del alone_cfg["stage_cache"]
    alone = run_pipeline(load_config(alone_cfg), say=lambda m: None)
    assert "blocks_cache" not in alone.rows[2].details["gptq_timing"]
    assert shared.rows[2].metrics.perplexity == alone.rows[2].metrics.perplexity
    from optimize import checkpoints as ckpt
    from optimize.stage_api import restorers

    a, _ = ckpt.load_stage(Path(shared.rows[2].artifact), restorers(load_config(alone_cfg).stages))
    b, _ = ckpt.load_stage(Path(alone.rows[2].artifact), restorers(load_config(alone_cfg).stages))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        if isinstance(x, TorchAOBaseTensor):
            assert torch.equal(x.qdata, y.qdata) and torch.equal(x.scale, y.scale), name
        else:
            assert torch.equal(x, y), name
