from __future__ import annotations

import json
import re

import yaml

from optimize.cli import main


def test_schema_prints_json_schema(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "PipelineConfig" and "stages" in schema["properties"]
    assert main(["schema", "--report"]) == 0
    assert "schema_version" in json.loads(capsys.readouterr().out)["properties"]


def test_ls_stages_lists_kinds_with_descriptions(capsys):
    assert main(["ls", "stages"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ptq_int8\s+\S", out, re.M)
    assert re.search(r"^test_noise\s+Add Gaussian weight noise", out, re.M)


def test_ls_targets(capsys):
    assert main(["ls", "targets"]) == 0
    out = capsys.readouterr().out
    assert "executorch" in out and "xnnpack" in out and "onnxruntime" in out


def test_validate_good_and_bad(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["validate", str(path)]) == 0
    assert "valid (version 1" in capsys.readouterr().out
    assert main(["validate", str(path), "data.eval_tokns=5"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "data.eval_tokns: unknown key 'eval_tokns'" in err


def test_pipeline_exit_code_follows_gates(tiny_cfg, tmp_path, capsys):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.3}]
    tiny_cfg["gates"] = {"top1_agreement": {"threshold": 0.99}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["pipeline", str(path)]) == 1
    out = capsys.readouterr().out
    assert "STOPPED at 0:test_noise" in out and "| baseline | eager |" in out
    assert main(["pipeline", str(path), "gates.on_fail=warn", "resume=false"]) == 0


def test_run_missing_artifact_is_a_clear_error(tmp_path, capsys):
    assert main(["run", str(tmp_path / "model.pte"), "--prompt", "hi"]) == 2
    assert f"artifact not found: {tmp_path / 'model.pte'}" in capsys.readouterr().err
