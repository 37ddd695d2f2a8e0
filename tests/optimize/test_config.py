"""Config validation: every bad input names its YAML path and what is allowed."""

from __future__ import annotations

import pytest
import yaml

from optimize.config import json_schema, load_config
from optimize.errors import ConfigError


def _err(data, overrides=(), **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data, overrides, **kw)
    return str(info.value)


def test_valid_tiny_config_loads(tiny_cfg):
    cfg = load_config(tiny_cfg)
    assert cfg.version == 1 and cfg.model.source == "random" and cfg.data.eval_tokens == 256


def test_unknown_top_level_key_names_path_and_allowed(tiny_cfg):
    tiny_cfg["stagez"] = []
    msg = _err(tiny_cfg)
    assert "stagez: unknown key 'stagez' (did you mean 'stages'?)" in msg
    assert "allowed keys:" in msg and "model" in msg and "version" in msg


def test_unknown_nested_key_names_full_path(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scael": 0.1}]
    msg = _err(tiny_cfg)
    assert "stages.0.scael: unknown key 'scael' (did you mean 'scale'?)" in msg
    assert "allowed keys: gates, kind, name, scale" in msg


def test_wrong_type_names_path(tiny_cfg):
    tiny_cfg["data"]["eval_tokens"] = "lots"
    assert "data.eval_tokens: Input should be a valid integer" in _err(tiny_cfg)


def test_stage_cache_takes_a_boolean_and_its_misspelling_is_named(tiny_cfg):
    tiny_cfg["stage_cache"] = "sometimes"
    assert "stage_cache: Input should be a valid boolean" in _err(tiny_cfg)
    del tiny_cfg["stage_cache"]
    tiny_cfg["stage_cach"] = True
    assert "stage_cach: unknown key 'stage_cach' (did you mean 'stage_cache'?)" in _err(tiny_cfg)


def test_out_of_range_value(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": -1}]
    assert "stages.0.scale: Input should be greater than or equal to 0" in _err(tiny_cfg)


def test_unknown_stage_kind_lists_registered_kinds(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "prune_everything"}]
    msg = _err(tiny_cfg)
    assert "stages.0:" in msg and "'prune_everything'" in msg
    assert "'test_noise'" in msg and "'ptq_int8'" in msg  # the allowed kinds are listed


def test_missing_kind(tiny_cfg):
    tiny_cfg["stages"] = [{"scale": 0.1}]
    assert "stages.0: Unable to extract tag using discriminator 'kind'" in _err(tiny_cfg)


def test_missing_model_path_says_which(tiny_cfg, tmp_path):
    tiny_cfg["model"] = {"source": "hf", "path": str(tmp_path / "no-such-model")}
    assert f"model.path: not found: {tmp_path / 'no-such-model'}" in _err(tiny_cfg)


def test_missing_gguf_file(tiny_cfg, tmp_path):
    tiny_cfg["model"] = {"source": "gguf", "path": str(tmp_path / "x.gguf")}
    assert "model.path: not found" in _err(tiny_cfg)


def test_unknown_model_source_lists_sources(tiny_cfg):
    tiny_cfg["model"] = {"source": "hub", "name": "gpt2"}
    msg = _err(tiny_cfg)
    assert "model:" in msg and "'hub'" in msg and "'hf', 'gguf', 'bundled', 'random'" in msg


def test_unknown_bundled_model(tiny_cfg):
    tiny_cfg["model"] = {"source": "bundled", "name": "llama-70b"}
    assert ("model.name: Input should be 'smollm2-135m', 'qwen2.5-coder-0.5b-instruct' or "
            "'qwen2.5-coder-1.5b-instruct' (got 'llama-70b')") in _err(tiny_cfg)


def test_gate_on_unknown_metric_lists_metrics(tiny_cfg):
    tiny_cfg["gates"] = {"bleu": {"threshold": 0.3}}
    msg = _err(tiny_cfg)
    assert "gates.bleu: unknown key 'bleu'" in msg
    assert "perplexity" in msg and "top1_agreement" in msg and "decode_tok_s" in msg


def test_gate_goal_needs_exactly_one_form(tiny_cfg):
    tiny_cfg["gates"] = {"perplexity": {"threshold": 20, "max_pct_degradation": 2}}
    assert "gates.perplexity: Value error, a metric goal takes exactly one of" in _err(tiny_cfg)


def test_relative_goal_on_baseline_relative_metric_refused(tiny_cfg):
    tiny_cfg["gates"] = {"top1_agreement": {"max_degradation": 0.1}}
    assert "top1_agreement is already measured against the baseline; give it a threshold" in _err(tiny_cfg)


def test_on_fail_allowed_values(tiny_cfg):
    tiny_cfg["gates"] = {"on_fail": "explode"}
    assert "gates.on_fail: Input should be 'stop' or 'warn' (got 'explode')" in _err(tiny_cfg)


def test_version_is_required_and_checked(tiny_cfg):
    del tiny_cfg["version"]
    assert "version: required key is missing" in _err(tiny_cfg)
    tiny_cfg["version"] = 2
    assert "version: Input should be 1 (got 2)" in _err(tiny_cfg)


def test_unknown_target_lists_targets(tiny_cfg):
    tiny_cfg["target"] = "tpu"
    assert "target: unknown target 'tpu'; available: executorch, onnxruntime" in _err(tiny_cfg)


def test_scheme_refused_by_target_names_stage_and_target(tiny_cfg, tmp_path):
    # the bundled profiles now run every scheme ptq_int8 makes: a user profile refuses one
    from targets import load_target

    profile = load_target("onnxruntime").model_dump()
    profile["allowed_schemes"] = ["fp32", "8da4w"]
    profile["refused_schemes"] = {"8da8w": "not on this device"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(profile))
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da8w"}]
    msg = _err(tiny_cfg, target=str(tmp_path / "mine.yaml"))
    assert "stages.0: stage '0:ptq_int8': target 'onnxruntime' refuses scheme '8da8w': not on this device" in msg


def test_unknown_exporter_block(tiny_cfg):
    tiny_cfg["export"] = {"tflite": {}}
    assert "export.tflite: unknown exporter; available: executorch, onnxruntime" in _err(tiny_cfg)


def test_several_problems_reported_together(tiny_cfg):
    tiny_cfg["data"]["seq_len"] = 1
    tiny_cfg["checks"]["latency"]["runs"] = 0
    msg = _err(tiny_cfg)
    assert "2 problems" in msg and "data.seq_len" in msg and "checks.latency.runs" in msg


def test_yaml_file_errors(tmp_path):
    assert "config file not found" in _err(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [1\n")
    assert "not valid YAML" in _err(bad)
    bad.write_text("- 1\n- 2\n")
    assert "the top level must be a mapping" in _err(bad)


def test_relative_paths_resolve_against_the_yaml_file(tmp_path, tiny_cfg):
    (tmp_path / "corpus.txt").write_text("hello " * 2000)
    tiny_cfg["data"]["corpus"] = "corpus.txt"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(tiny_cfg))
    cfg = load_config(tmp_path / "p.yaml")
    assert cfg.data.corpus == str(tmp_path / "corpus.txt")


def test_schema_has_stage_union_and_version():
    schema = json_schema()
    assert "version" in schema["required"]
    text = str(schema)
    assert "ptq_int8" in text and "discriminator" in text


def test_a_crashing_preflight_check_is_reported_not_raised(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_boom", "in_check": True}, {"kind": "test_noise"}]
    with pytest.raises(ConfigError) as err:
        load_config(tiny_cfg)
    assert err.value.problems == [
        ("stages.0", "stage '0:test_boom': its pre-flight check failed on this model (KeyError: 'boom in check_model')")
    ]


def test_every_pipeline_example_validates():
    """Each examples/*.yaml loads as written (a typo there would only surface in ``make demo``), and
    the main job calibrates GPTQ on 32 windows of its 16384 calibration tokens (README: the
    host-dependent GPTQ figures and why 32)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    names = sorted(p.name for p in root.glob("*.yaml"))
    assert {"smollm2.yaml", "smollm2_int8.yaml", "smollm2_onnx.yaml", "tiny.yaml"} <= set(names)
    from targets.sources import ModelSourceError, bundled_model
    from targets.sources.bundled import part_files

    for name in names:
        model = yaml.safe_load((root / name).read_text()).get("model") or {}
        try:
            if model.get("source") == "bundled":
                part_files(bundled_model(model["name"]))  # installed? (make qwen for the Qwen examples)
        except ModelSourceError as exc:  # not here: the schema still validates, and the full check says why
            load_config(root / name, check_files=False, check_model=False)
            with pytest.raises(ConfigError, match="make qwen"):  # as optimize validate refuses it
                load_config(root / name)
            assert "make qwen" in str(exc)
            continue
        load_config(root / name, check_files=False)
    demo = load_config(root / "smollm2.yaml", check_files=False)
    ptq = next(s for s in demo.stages if s.kind == "ptq_int8")
    assert ptq.algorithm == "gptq" and ptq.gptq.calibration_windows == 32
    assert demo.data.calibration_tokens >= 32 * demo.data.seq_len
