"""checks.baseline_cache: a second run of the same model on the same text reuses the baseline's
perplexity and log-probabilities (every later row's agreement and KL unchanged to the bit); any
change to the weights or the text measures again; a damaged entry is never trusted."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from optimize import load_config, run_pipeline
from optimize.checks import baseline_cache
from optimize.checks.accuracy import BaselineLogits


@pytest.fixture()
def cache(private_cache):
    return private_cache / "baselines"


def _cfg(tiny_cfg, tmp_path, name: str, **checks) -> dict:
    cfg = copy.deepcopy(tiny_cfg)
    cfg["output_dir"] = str(tmp_path / name)
    cfg["stages"] = [{"kind": "test_noise", "scale": 0.02}]
    cfg["checks"] = {"latency": {"enabled": False}, "generate_tokens": 0, "baseline_cache": True, **checks}
    return cfg


def test_second_run_reuses_the_baseline_and_every_row_is_unchanged(tiny_cfg, tmp_path, cache, monkeypatch):
    from optimize import measure

    first = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "a")), say=lambda m: None)
    assert first.ok and first.rows[0].details["baseline_cache"]["used"] is False
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1

    calls = []
    real = measure.evaluate
    monkeypatch.setattr(measure, "evaluate", lambda *a, **k: calls.append(k.get("desc")) or real(*a, **k))
    said: list[str] = []
    second = run_pipeline(load_config(_cfg(tiny_cfg, tmp_path, "b")), say=said.append)
    assert second.ok and second.rows[0].details["baseline_cache"]["used"] is True
    assert calls == ["eval"], calls  # the stage's row only: the baseline was not evaluated again
    assert any("reused from" in m for m in said)
    for a, b in zip(first.rows, second.rows):
        for metric in ("perplexity", "top1_agreement", "kl_divergence", "perplexity_delta_pct", "eval_tokens"):
            assert getattr(a.metrics, metric) == getattr(b.metrics, metric), (a.name, metric)
    # the run's own copy of the log-probabilities is gone with the run; the cache keeps its entry
    assert not list((tmp_path / "b").glob("baseline-logprobs-*"))
    assert any(cache.iterdir())


def test_off_by_default_and_nothing_is_written(tiny_cfg, tmp_path, cache):
    cfg = _cfg(tiny_cfg, tmp_path, "a")
    del cfg["checks"]["baseline_cache"]
    report = run_pipeline(load_config(cfg), say=lambda m: None)
    assert report.ok and "baseline_cache" not in report.rows[0].details
    assert not cache.exists()


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_other_weights_or_text_are_other_keys(model_type):
    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    base = family(model_type).eval()
    model = copy.deepcopy(base)
    windows = [torch.arange(0, 33), torch.arange(33, 60)]
    key = baseline_cache.baseline_key(model, windows, threads=2)
    assert key == baseline_cache.baseline_key(copy.deepcopy(model), [w.clone() for w in windows], threads=2)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-7  # one weight, one ulp-scale step
    assert baseline_cache.baseline_key(model, windows, threads=2) != key
    model = copy.deepcopy(base)
    assert baseline_cache.baseline_key(model, [windows[0], windows[1][:-1]], threads=2) != key
    assert baseline_cache.baseline_key(model, windows, threads=1) != key


def _entry(root, key="k" * 24, windows=2):
    base = BaselineLogits()
    for i in range(windows):
        base.add(torch.full((4, 8), float(-i), dtype=torch.float16), torch.arange(4) + i)
    return baseline_cache.store(key, base, perplexity=3.5, tokens=8, root=root)


def test_a_damaged_entry_is_a_miss_and_the_run_measures(tmp_path):
    root = tmp_path / "baselines"
    entry = _entry(root)
    into = BaselineLogits(directory=tmp_path / "spill")
    hit = baseline_cache.load("k" * 24, into, root=root)
    assert hit is not None and hit.perplexity == 3.5 and into.spilled == 2
    assert torch.equal(into.logprobs_at(1), torch.full((4, 8), -1.0, dtype=torch.float16))
    assert torch.equal(into.top1[1], torch.arange(4) + 1)

    (entry / "logprobs-00001.pt").unlink()
    into = BaselineLogits(directory=tmp_path / "spill2")
    assert baseline_cache.load("k" * 24, into, root=root) is None and len(into) == 0 and into.spilled == 0
    (entry / baseline_cache.RESULT).write_text("{not json")
    assert baseline_cache.load("k" * 24, BaselineLogits(), root=root) is None
    result = {"key": "another", "perplexity": 1.0, "tokens": 8, "windows": 2}
    (entry / baseline_cache.RESULT).write_text(json.dumps(result))
    assert baseline_cache.load("k" * 24, BaselineLogits(), root=root) is None


def test_only_the_most_recently_used_entries_stay(tmp_path, monkeypatch):
    import os

    root = tmp_path / "baselines"
    monkeypatch.setattr(baseline_cache, "KEEP", 2)
    for n, key in enumerate(["a" * 24, "b" * 24, "c" * 24]):
        _entry(root, key)
        os.utime(root / key, (1000 + n, 1000 + n))
    _entry(root, "d" * 24)  # storing evicts the least recently used
    assert sorted(p.name[0] for p in root.iterdir()) == ["c", "d"]
    assert baseline_cache.load("c" * 24, BaselineLogits(), root=root) is not None  # in memory without a directory


def test_a_wrong_value_or_a_misspelt_key_names_its_yaml_path(tiny_cfg):
    from optimize.errors import ConfigError

    for checks, expected in (({"baseline_cache": "sometimes"}, "checks.baseline_cache"),
                             ({"baseline_cach": True}, "baseline_cache")):
        cfg = copy.deepcopy(tiny_cfg) | {"checks": checks}
        with pytest.raises(ConfigError) as info:
            load_config(cfg)
        assert expected in str(info.value), str(info.value)
