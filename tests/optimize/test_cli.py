from __future__ import annotations

import json
import logging
import re

import pytest
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
    # a run whose gate only warned does not end with "all gates passed": it names the gate and its figure
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("warn: finished with 1 gate(s) failed as warnings: 0:test_noise: ") and "top1" in last, last
    assert "all gates passed" not in last


def test_run_missing_artifact_is_a_clear_error(tmp_path, capsys):
    assert main(["run", str(tmp_path / "model.pte"), "--prompt", "hi"]) == 2
    assert f"artifact not found: {tmp_path / 'model.pte'}" in capsys.readouterr().err


# ---- options and overrides in any order (the README writes overrides after --target)

PARSE_CASES = {
    "pipeline": (["p.yaml", "--target", "executorch", "stages.0.scheme=8da4w", "--output", "out", "seed=3"],
                 ["p.yaml", "stages.0.scheme=8da4w", "seed=3", "--target", "executorch", "--output", "out"],
                 {"target": "executorch", "output": "out"}),
    "validate": (["p.yaml", "--target", "executorch", "stages.0.scheme=8da4w", "seed=3"],
                 ["p.yaml", "stages.0.scheme=8da4w", "seed=3", "--target", "executorch"],
                 {"target": "executorch"}),
    "sensitivity": (["p.yaml", "--scheme", "8da4w", "stages.0.scheme=8da4w", "--windows", "2", "seed=3"],
                    ["p.yaml", "stages.0.scheme=8da4w", "seed=3", "--windows", "2", "--scheme", "8da4w"],
                    {"scheme": "8da4w", "windows": 2}),
    "train": (["r.yaml", "-v", "stages.0.scheme=8da4w", "seed=3"],
              ["r.yaml", "stages.0.scheme=8da4w", "seed=3", "-v"],
              {"verbose": True}),
}


@pytest.mark.parametrize("command", sorted(PARSE_CASES))
def test_overrides_parse_before_and_after_options(command):
    from optimize.cli import build_parser

    after, before, options = PARSE_CASES[command]
    for argv in (after, before):
        args = build_parser().parse_args([command, *argv])
        first = "recipe" if command == "train" else "config"
        assert getattr(args, first) == argv[0]
        assert args.overrides == ["stages.0.scheme=8da4w", "seed=3"], argv
        for key, value in options.items():
            assert getattr(args, key) == value, (argv, key)


def test_verbose_before_or_after_the_command():
    from optimize.cli import build_parser

    assert build_parser().parse_args(["-v", "validate", "p.yaml"]).verbose is True
    assert build_parser().parse_args(["validate", "p.yaml", "-v"]).verbose is True
    assert build_parser().parse_args(["validate", "p.yaml"]).verbose is False


def test_missing_positional_names_only_what_is_missing(capsys):
    with pytest.raises(SystemExit):
        main(["validate"])
    err = capsys.readouterr().err
    assert "required: config" in err and "overrides" not in err.splitlines()[-1]


def test_validate_readme_form_both_orders(tiny_cfg, tmp_path, capsys):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da8w"}]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    for argv in (["validate", str(path), "--target", "executorch", "stages.0.scheme=8da4w"],
                 ["validate", str(path), "stages.0.scheme=8da4w", "--target", "executorch"]):
        assert main(argv) == 0, capsys.readouterr().err
        assert "target: executorch" in capsys.readouterr().out
    # the override really applied: a value the scheme check refuses is reported by its path
    assert main(["validate", str(path), "--target", "executorch", "stages.0.scheme=w8"]) == 2
    assert "stages.0" in capsys.readouterr().err


def test_pipeline_override_after_option_runs(tiny_cfg, tmp_path, capsys):
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.3}]
    tiny_cfg["checks"]["latency"]["enabled"] = False
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    out = tmp_path / "elsewhere"
    assert main(["pipeline", str(path), "--output", str(out), "stages.0.scale=0.0"]) == 0
    assert (out / "report.json").is_file()
    assert json.loads((out / "report.json").read_text())["config"]["stages"][0]["scale"] == 0.0


# ---- expected failures: one line, no traceback; -v shows it


def _raiser(exc):
    def fn(args):
        raise exc

    return fn


def _expected_errors():
    from export.base import ExportError
    from export.decoding.runtime import RunnerError
    from optimize.checkpoints import CheckpointError
    from optimize.errors import ConfigError
    from optimize.rewrites.ln_plans import RewriteRefused
    from targets import TargetError
    from targets.sources.corpus import CorpusError
    from train.recipe import RecipeError
    from targets.sources import ModelSourceError

    return [
        ConfigError("p.yaml", [("stages.0.scheme", "not allowed")]),
        FileNotFoundError("artifact not found: x.pte"),
        ExportError("executorch cannot export gemma3_text"),
        RunnerError("ONNX Runtime could not load x.onnx"),
        ModelSourceError("/m is not a causal language model"),
        RewriteRefused("rmsnorm: exact rewrite refused"),
        CheckpointError("stage checkpoint s/model.pt cannot be loaded"),
        TargetError("unknown target 'x'"),
        CorpusError("corpus not found"),
        RecipeError("recipe not found: r.yaml"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_expected_errors_print_one_line_and_traceback_only_with_v(index, monkeypatch, capsys):
    exc = _expected_errors()[index]
    monkeypatch.setattr("optimize.cli.cmd_schema", _raiser(exc))
    assert main(["schema"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(exc) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == len(str(exc).splitlines())
    with pytest.raises(type(exc)):
        main(["-v", "schema"])


def test_value_error_raised_by_our_code_is_expected_but_a_library_bug_keeps_its_traceback(monkeypatch, capsys):
    from export.decoding.runtime import greedy_generate

    def ours(args):
        greedy_generate(None, [], 4)  # raises ValueError on purpose, inside our package

    monkeypatch.setattr("optimize.cli.cmd_schema", ours)
    assert main(["schema"]) == 2
    assert capsys.readouterr().err == "error: greedy_generate needs a non-empty prompt\n"

    def library(args):
        return int("not a number")  # ValueError raised inside Python, not by us

    monkeypatch.setattr("optimize.cli.cmd_schema", library)
    with pytest.raises(ValueError):
        main(["schema"])
    monkeypatch.setattr("optimize.cli.cmd_schema", _raiser(ZeroDivisionError("bug")))
    with pytest.raises(ZeroDivisionError):
        main(["schema"])


def test_an_implicit_value_error_in_our_code_is_a_bug_not_a_refusal(monkeypatch):
    """Only a ValueError our code raises on purpose (a ``raise`` statement) reads as bad input; one
    that Python raises inside our code (here ``int("two")`` in train/distributed.py) is a bug."""
    from train.config import DistributedConfig
    from train.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setattr("optimize.cli.cmd_schema", lambda args: init_distributed("cpu", DistributedConfig()))
    with pytest.raises(ValueError, match="invalid literal for int"):
        main(["schema"])


def _train_recipe(tmp_path, **train) -> str:
    from tests.conftest import TINY_CONFIGS

    recipe = {
        "model": {"source": "random", "seed": 0, "config": dict(TINY_CONFIGS["llama"])},
        "data": {"corpus": "pydoc", "seq_len": 32, "max_tokens": 2000},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "logging": {"progress_bar": False}, **train},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_train_verb_refuses_a_bad_recipe_in_one_message(tmp_path, capsys):
    assert main(["train", _train_recipe(tmp_path, compile="fast")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "train.compile: compile takes true, false or a mapping" in err
    assert "Traceback" not in err


def test_train_verb_internal_error_keeps_its_traceback(tmp_path, monkeypatch):
    """issue 27: an internal ValueError during training (torchao's unpack under FSDP2) is a bug (exit 1)."""

    def broken(*args, **kwargs):
        raise RuntimeError("internal: injected")

    monkeypatch.setattr("train.api.load_model", broken)
    with pytest.raises(RuntimeError, match="internal: injected"):
        main(["train", _train_recipe(tmp_path)])


def test_missing_config_file_is_one_line(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"config file not found: {tmp_path / 'nope.yaml'}" in err and "Traceback" not in err


def test_encoder_model_is_refused_in_one_clear_message(tiny_cfg, tiny_config, tmp_path, capsys):
    from transformers import AutoConfig, AutoModel

    d = tiny_config("bert")
    AutoModel.from_config(AutoConfig.for_model(d.pop("model_type"), **d)).save_pretrained(tmp_path / "enc")
    tiny_cfg["model"] = {"source": "hf", "path": str(tmp_path / "enc")}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["pipeline", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model: " in err and "is not a causal language model" in err and "Traceback" not in err


def test_stage_refusal_at_preflight_is_one_message(tiny_cfg, tiny_config, tmp_path, capsys):
    """rmsnorm cannot fold a post-LayerNorm OPT exactly: refused before any stage runs."""
    tiny_cfg["model"]["config"] = tiny_config("opt", do_layer_norm_before=False)
    tiny_cfg["stages"] = [{"kind": "rmsnorm"}]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["pipeline", str(path)]) == 2
    err = capsys.readouterr().err
    assert "stages.0: stage '0:rmsnorm'" in err and "post-LayerNorm" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "stages").exists()


def test_stage_crash_stops_the_run_without_traceback(tiny_cfg, tiny_config, tmp_path, capsys):
    tiny_cfg["model"]["config"] = tiny_config("qwen3")
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["stages"] = [{"kind": "test_boom"}]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["pipeline", str(path)]) == 1
    captured = capsys.readouterr()
    assert "0:test_boom failed: RuntimeError: boom: this stage always fails" in captured.err
    assert "Traceback" not in captured.err and "STOPPED at 0:test_boom" in captured.out



def test_pipeline_progress_flag_bars_on_a_terminal_messages_only_otherwise(tiny_cfg, tmp_path, capsys):
    tiny_cfg["checks"]["latency"]["enabled"] = False
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.01}]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    # not a terminal (the default under pytest): the run's messages on stderr, no bars, library output in the log
    assert main(["pipeline", str(path)]) == 0
    captured = capsys.readouterr()
    assert "stage 0:test_noise: " in captured.err and "report: " in captured.err
    assert "stages:" not in captured.err and "| 0:test_noise | eager |" in captured.out
    log = (tmp_path / "run" / "pipeline.log").read_text()
    assert "stage 0:test_noise: " in log and "baseline:" in log  # the eval bar went to the log
    # --progress: bars as on a terminal
    assert main(["pipeline", str(path), "--progress", "resume=false"]) == 0
    err = capsys.readouterr().err
    assert "stages:" in err and "stage 0:test_noise: " in err


def test_noise_filter_drops_library_chatter_but_never_our_own_warnings():
    """A warning of ours that quotes a library's "Failed to load ..." reaches the user (the C++
    tokenizer's refusal, in the runner fallback's warning, was dropped with torchao's noise)."""
    from optimize.quiet import DropNoise

    def record(name, msg):
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, None)

    noise = DropNoise()
    assert not noise.filter(record("torchao", "Failed to load /x/_C.so: undefined symbol"))
    assert noise.filter(record("torchao", "something else"))
    assert noise.filter(record("optimize.generate", "using the Python loop instead: Failed to load tokenizer"))
    assert noise.filter(record("export.executorch.runner", "Failed to load x"))
