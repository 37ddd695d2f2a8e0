from __future__ import annotations

import pytest

from optimize.config import load_config
from optimize.errors import ConfigError
from optimize.overrides import OverrideError, apply_overrides


def test_sets_nested_values_with_yaml_types():
    data = {"stages": [{"kind": "ptq_int8", "group_size": 32}], "data": {}}
    apply_overrides(data, ["stages.0.group_size=64", "data.eval_tokens=1024", "gates.on_fail=warn", "x.y=[1, 2]"])
    assert data["stages"][0]["group_size"] == 64
    assert data["data"]["eval_tokens"] == 1024
    assert data["gates"] == {"on_fail": "warn"}
    assert data["x"] == {"y": [1, 2]}


@pytest.mark.parametrize(
    "override, message",
    [
        ("stages", "must look like key.path=value"),
        ("stages.5.scale=1", "stages.5 is out of range (the list has 1 items)"),
        ("stages.first.scale=1", "stages.first indexes a list; use a number"),
        ("name.x=1", "name is a value, not a mapping or list"),
        ("a..b=1", "has an empty key path"),
    ],
)
def test_bad_overrides_say_why(override, message):
    with pytest.raises(OverrideError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides({"name": "n", "stages": [{}]}, [override])


def test_override_then_validation_names_path(tiny_cfg):
    tiny_cfg["stages"] = [{"kind": "test_noise"}]
    cfg = load_config(tiny_cfg, ["stages.0.scale=0.5"])
    assert cfg.stages[0].scale == 0.5
    with pytest.raises(ConfigError, match="stages.0.bits: unknown key 'bits'"):
        load_config(tiny_cfg, ["stages.0.bits=8"])
