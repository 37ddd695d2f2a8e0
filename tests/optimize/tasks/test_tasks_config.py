"""checks.tasks and gates.tasks: errors name the YAML path and the allowed values."""

from __future__ import annotations

import pytest

from optimize.config import ConfigError, load_config
from optimize.tasks.config import TASK_NAMES, TasksConfig


def _load(cfg):
    return load_config(cfg, check_model=False)


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_unknown_task_names_the_path_and_near_names(tiny_cfg):
    """Any task lm-eval knows is accepted (MMLU's data is in the wheel); an unknown one is refused by
    name with lm-eval's nearest names."""
    pytest.importorskip("lm_eval")
    tiny_cfg["checks"]["tasks"] = {"names": ["hellaswag", "mmlu", "arc_eazy"]}
    with pytest.raises(ConfigError) as err:
        _load(tiny_cfg)
    msg = str(err.value)
    assert "checks.tasks.names" in msg and "unknown task 'arc_eazy'" in msg and "did you mean arc_easy" in msg
    assert "1 problem" in msg  # hellaswag and mmlu are fine
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa", ""]}
    with pytest.raises(ConfigError, match="checks.tasks.names"):
        _load(tiny_cfg)
    assert "hellaswag" in TASK_NAMES


def test_unknown_key_and_bad_limit(tiny_cfg):
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa"], "limt": 5}
    with pytest.raises(ConfigError, match="limt"):
        _load(tiny_cfg)
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa"], "limit": 0}
    with pytest.raises(ConfigError, match="checks.tasks.limit"):
        _load(tiny_cfg)
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa"], "expand_groups": "sometimes"}
    with pytest.raises(ConfigError, match="checks.tasks.expand_groups"):
        _load(tiny_cfg)
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa"], "num_fewshot": -1}
    with pytest.raises(ConfigError, match="checks.tasks.num_fewshot"):
        _load(tiny_cfg)


def test_include_path_must_be_folders(tiny_cfg, tmp_path):
    pytest.importorskip("lm_eval")
    (tmp_path / "a_file.yaml").write_text("task: x\n")
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa"], "include_path": [str(tmp_path / "a_file.yaml"),
                                                                       str(tmp_path / "missing")]}
    with pytest.raises(ConfigError) as err:
        _load(tiny_cfg)
    msg = str(err.value)
    assert "checks.tasks.include_path.0:" in msg and "a_file.yaml' is not a folder" in msg
    assert "checks.tasks.include_path.1:" in msg and "missing' is not a folder" in msg


def test_rows_must_name_rows_of_the_run(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_noise"}]
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa"], "rows": ["baseline", "0:test_noise", "1:awq"]}
    with pytest.raises(ConfigError) as err:
        _load(tiny_cfg)
    assert "checks.tasks.rows.2" in str(err.value) and "'1:awq' names no row" in str(err.value)
    tiny_cfg["checks"]["tasks"]["rows"] = ["baseline", 0, "test_noise"]
    cfg = _load(tiny_cfg)
    assert cfg.checks.tasks.rows == ["baseline", 0, "test_noise"]


def test_task_gates_need_the_task_scored_and_the_baseline(tiny_cfg):
    tiny_cfg["checks"]["tasks"] = {"names": ["piqa"], "rows": ["0:test_noise"]}
    tiny_cfg["stages"] = [{"kind": "test_noise"}]
    tiny_cfg["gates"] = {"tasks": {"hellaswag": {"max_degradation": 2}, "piqa": {"max_degradation": 2}}}
    with pytest.raises(ConfigError) as err:
        _load(tiny_cfg)
    msg = str(err.value)
    assert "gates.tasks" in msg and "hellaswag, which checks.tasks.names does not score" in msg
    assert "add 'baseline'" in msg
    tiny_cfg["gates"] = {"tasks": {"mmlu": {"threshold": 30}}}
    with pytest.raises(ConfigError, match="gate on mmlu, which checks.tasks.names does not score"):
        _load(tiny_cfg)


def test_defaults_and_selection():
    t = TasksConfig(names=["piqa"])
    assert t.rows == ["baseline", "export"] and t.num_fewshot == 0 and t.limit is None and t.include_path == []
    assert t.selects(-1, "baseline", "baseline") and t.selects(2, "export:executorch", "export:executorch")
    assert not t.selects(0, "0:awq", "awq")
    assert TasksConfig(names=["piqa"], rows=[0]).selects(0, "0:awq", "awq")
    assert not TasksConfig().enabled


def test_the_executorch_export_gets_its_scoring_method_exactly_when_tasks_score_it(tiny_cfg):
    import copy

    from optimize.config import load_config
    from optimize.config_checks import export_options
    from targets.profile import load_target

    profile = load_target("executorch")

    def resolved(tasks=None, block=None):
        cfg = copy.deepcopy(tiny_cfg)
        cfg["target"] = "executorch"
        if tasks is not None:
            cfg["checks"]["tasks"] = tasks
        if block is not None:
            cfg["export"] = {"executorch": block}
        return export_options(load_config(cfg), "executorch", profile).scoring_method

    assert resolved({"names": ["piqa"]}) is True  # rows default to baseline + export
    assert resolved({"names": ["piqa"], "rows": ["baseline"]}) is False
    assert resolved() is False
    assert resolved({"names": ["piqa"]}, {"scoring_method": False}) is False  # the YAML's word stands
    assert resolved({"names": ["piqa"]}, {"logits": "all"}) is False  # forward returns every position already
