"""Recipe YAML: overrides, and errors that name the file and the dotted key."""

from __future__ import annotations

import pytest
import yaml

from train.recipe import RecipeError, load_recipe, parse_recipe


def _write(tmp_path, text: str):
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


def test_examples_validate(th):
    for name in ("limited_hardware.yaml", "multi_gpu.yaml"):
        recipe = load_recipe(th.REPO / "examples" / "train" / name)
        assert recipe.train.lora.quantize_base == "nf4"
    assert load_recipe(th.REPO / "examples/train/multi_gpu.yaml").train.distributed.fsdp


def test_unknown_key_names_path_and_suggestion(tmp_path, th):
    recipe = th.tiny_recipe(tmp_path)
    recipe["train"]["optimizer"]["lrr"] = 0.1
    p = th.write_recipe(tmp_path / "r.yaml", recipe)
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    msg = str(exc.value)
    assert str(p) in msg
    assert "train.optimizer: unknown key 'lrr' (did you mean 'lr'?)" in msg
    assert "allowed keys: betas, cpu_offload, eps, lr, name, weight_decay" in msg


def test_wrong_type_and_range_are_dotted(tmp_path):
    p = _write(
        tmp_path,
        "model: {source: random, config: {model_type: llama}}\n"
        "train: {optimizer: {lr: fast}, batch: {micro_batch_size: 0}}\n",
    )
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    msg = str(exc.value)
    assert "2 problems" in msg
    assert "train.optimizer.lr: Input should be a valid number" in msg
    assert "train.batch.micro_batch_size: Input should be greater than or equal to 1" in msg


def test_missing_model_and_bad_source(tmp_path):
    with pytest.raises(RecipeError, match=r"model: Field required"):
        load_recipe(_write(tmp_path, "train: {max_steps: 3}\n"))
    with pytest.raises(RecipeError, match=r"model: Input tag 'hub' found using 'source' does not match"):
        load_recipe(_write(tmp_path, "model: {source: hub}\n"))


def test_cross_field_rules(tmp_path, th):
    recipe = th.tiny_recipe(tmp_path)
    recipe["train"]["precision"] = {"mode": "fp16"}
    recipe["train"]["distributed"] = {"fsdp": True}
    with pytest.raises(RecipeError, match=r"train: precision.mode fp16 is not supported with distributed.fsdp"):
        parse_recipe(recipe)
    recipe = th.tiny_recipe(tmp_path)
    with pytest.raises(RecipeError, match=r"lora.quantize_base needs lora.enabled"):
        parse_recipe(recipe, overrides=["train.lora.quantize_base=nf4"])


def test_not_yaml_missing_file_and_not_mapping(tmp_path):
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(_write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(RecipeError, match="must be a YAML mapping, got list"):
        load_recipe(_write(tmp_path, "- a\n- b\n"))


def test_overrides(tmp_path, th):
    p = th.write_recipe(tmp_path / "r.yaml", th.tiny_recipe(tmp_path))
    r = load_recipe(p, ["train.optimizer.lr=0.5", "train.lora.enabled=true", "data.seq_len=32"])
    assert r.train.optimizer.lr == 0.5 and r.train.lora.enabled and r.data.seq_len == 32
    with pytest.raises(RecipeError, match="must look like key.path=value"):
        load_recipe(p, ["train.optimizer.lr"])
    with pytest.raises(RecipeError, match="train.optimizer.lr: Input should be greater than 0"):
        load_recipe(p, ["train.optimizer.lr=-1"])
    loop = load_recipe(p, ["data.num_workers=2"]).loop_config()
    assert loop.data_workers == 2


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_cli_bad_recipe_exit_code(tmp_path, th):
    import subprocess
    import sys

    p = _write(tmp_path, yaml.safe_dump({"model": {"source": "random", "config": {}}, "train": {"max_stepz": 1}}))
    proc = subprocess.run(
        [sys.executable, "-m", "train", str(p)], cwd=th.REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "train: unknown key 'max_stepz' (did you mean 'max_steps'?)" in proc.stderr
