"""The pipeline's export step: one gated row per artifact, and a re-run reuses the export.

A small test exporter (registered for these tests only) writes two artifacts, each a saved
state dict that its runner loads as an eager model, and counts its calls, so the tests can
tell an export from a reuse.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from export import base as export_base
from export.base import ExportOptions, ExportResult, Exporter
from export.decoding.runtime import EagerRunner
from optimize import load_config, run_pipeline

CALLS: list[Path] = []


class _StateDictRunner(EagerRunner):
    runtime = "state_dict"

    def __init__(self, path: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path.parent))
        model.load_state_dict(torch.load(path, weights_only=True), strict=False)
        model.tie_weights()
        super().__init__(model.eval())
        self.path = path

    def size_bytes(self) -> int:
        return self.path.stat().st_size


class TwoArtifactExporter(Exporter):
    name = "test_two"
    options_model = ExportOptions
    suffixes = (".sd",)

    def export(self, model, tokenizer, out_dir, options, *, calibration=(), log=print):
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        CALLS.append(out_dir)
        model.config.save_pretrained(out_dir)
        for name in ("main.sd", "second.sd"):
            torch.save(model.state_dict(), out_dir / name)
        return ExportResult(artifact=out_dir / "main.sd", files=[out_dir / "config.json"],
                            details={"which": "main"}, extra_artifacts={"second": out_dir / "second.sd"},
                            extra_details={"second": {"which": "second"}})

    def load(self, artifact, **kwargs):
        return _StateDictRunner(Path(artifact))


@pytest.fixture()
def two_target(tmp_path, monkeypatch):
    monkeypatch.setitem(export_base._EXPORTERS, "test_two", f"{__name__}:TwoArtifactExporter")
    profile = {"name": "two", "description": "test", "exporter": "test_two", "backend": "eager",
               "max_seq_len": 1024, "allowed_schemes": ["fp32"]}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(profile))
    CALLS.clear()
    return str(path)


def _run(cfg, messages=None):
    return run_pipeline(load_config(cfg), say=(messages.append if messages is not None else lambda m: None))


def test_each_artifact_gets_a_gated_row(tiny_cfg, two_target):
    tiny_cfg["target"] = two_target
    tiny_cfg["gates"] = {"top1_agreement": {"threshold": 0.99}}
    report = _run(tiny_cfg)
    assert report.ok, [(r.name, r.status, r.error) for r in report.rows]
    names = [r.name for r in report.rows]
    assert names == ["baseline", "export:two", "export:two:second"]
    main, second = report.rows[1:]
    base = report.rows[0].metrics.perplexity
    for row, which in ((main, "main"), (second, "second")):
        assert row.runtime == "state_dict" and row.details["which"] == which
        assert row.metrics.perplexity == pytest.approx(base, rel=1e-5)
        assert row.gates and all(g.ok for g in row.gates)
        assert row.details["greedy"]["match"] and row.details["parity_vs_eager"]["max_abs_diff"] < 1e-4
    assert "export_s" in main.details and "export_s" not in second.details
    assert report.last_good_artifact.endswith("main.sd")


def test_rerun_reuses_the_export_and_remeasures_when_checks_change(tiny_cfg, two_target, tmp_path):
    tiny_cfg["target"] = two_target
    first = _run(tiny_cfg)
    assert len(CALLS) == 1 and first.ok

    messages: list[str] = []
    again = _run(tiny_cfg, messages)
    assert len(CALLS) == 1, "an unchanged pipeline must not export again"
    assert any("export: reusing" in m for m in messages)
    for old, new in zip(first.rows[1:], again.rows[1:]):
        assert new.status == "resumed" and new.details["export_cache"] == "reused artifact and measurements"
        assert new.metrics.perplexity == old.metrics.perplexity

    tiny_cfg["checks"]["generate_tokens"] = 3  # the artifact is the same; its measurements are not
    remeasured = _run(tiny_cfg)
    assert len(CALLS) == 1
    assert remeasured.rows[1].details["export_cache"] == "reused artifact, re-measured (checks changed)"
    assert remeasured.rows[1].details["greedy"]["tokens"] == 3 and remeasured.rows[1].status == "pass"


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_changed_or_damaged_artifacts_export_again(tiny_cfg, two_target):
    tiny_cfg["target"] = two_target
    _run(tiny_cfg)
    cache = Path(tiny_cfg["output_dir"]) / "export" / "two.cache.json"
    entry = json.loads(cache.read_text())
    second = Path(entry["result"]["extra_artifacts"]["second"])
    with open(second, "ab") as fh:  # a damaged artifact is never reused
        fh.write(b"\0")
    _run(tiny_cfg)
    assert len(CALLS) == 2

    tiny_cfg["seed"] = 7  # a different model digest
    _run(tiny_cfg)
    assert len(CALLS) == 3

    tiny_cfg["resume"] = False  # resume off: always export
    _run(tiny_cfg)
    assert len(CALLS) == 4
