"""``python -m train`` exit codes: a refusal of bad input is one line and 2; an internal error
keeps its traceback and exits 1 (issue 27: torchao's unpacking ValueError was printed as one line
with exit 2, as if the recipe were wrong)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from train.__main__ import main


def test_bad_recipe_is_one_error_and_exit_2(tmp_path, th, capsys):
    recipe = th.tiny_recipe(tmp_path / "run")
    recipe["train"]["max_stepz"] = 1
    path = th.write_recipe(tmp_path / "r.yaml", recipe)
    assert main([str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "train: unknown key 'max_stepz'" in err and "Traceback" not in err


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_a_refusal_while_training_is_one_line_and_exit_2(tmp_path, th):
    """Refused after the model loaded (a ValueError train/lora.py raises on purpose), in a real process."""
    recipe = th.tiny_recipe(tmp_path / "run", lora=dict(enabled=True, target_modules=["no_such_proj"]))
    path = th.write_recipe(tmp_path / "r.yaml", recipe)
    proc = subprocess.run([sys.executable, "-m", "train", str(path), "--quiet"], cwd=th.REPO, env=th.env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "lora.target_modules ['no_such_proj'] match no Linear layer" in errors[0]
    assert "Traceback" not in proc.stderr


def test_an_internal_error_keeps_its_traceback(tmp_path, th, monkeypatch):
    def broken(source):
        outputs = (1,)
        a, b, c = outputs  # an internal ValueError, as torchao's was

    monkeypatch.setattr("train.api.load_model", broken)
    path = th.write_recipe(tmp_path / "r.yaml", th.tiny_recipe(tmp_path / "run"))
    with pytest.raises(ValueError, match="not enough values to unpack"):
        main([str(path), "--quiet"])


def test_an_internal_error_exits_1_with_a_traceback(tmp_path, th):
    """The same in a real process: the status the shell and torchrun see."""
    path = th.write_recipe(tmp_path / "r.yaml", th.tiny_recipe(tmp_path / "run"))
    code = (
        "import sys, train.api as api\n"
        "def broken(source):\n"
        "    raise RuntimeError('internal: injected')\n"
        "api.load_model = broken\n"
        "from train.__main__ import main\n"
        f"sys.exit(main([{str(path)!r}, '--quiet']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=th.REPO, env=th.env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "RuntimeError: internal: injected" in proc.stderr
    assert "error: " not in proc.stderr
