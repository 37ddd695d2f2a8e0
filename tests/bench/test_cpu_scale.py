"""bench/cpu_scale.py: the config it runs is a valid pipeline config of the 1B shape, the weights'
bytes count a tied head once, and the table says whether the 2.5x goal is met."""

from __future__ import annotations

import pytest

from tests.bench.conftest import load_bench_script


@pytest.fixture(scope="module")
def cpu_scale():
    yield from load_bench_script("cpu_scale")


def test_the_config_is_the_1b_shape_through_awq_and_gptq(cpu_scale):
    from optimize.config import load_config

    cfg = load_config(cpu_scale.config(3, 4, "smollm2-135m"))
    assert cfg.device == "cpu" and cfg.model.dtype == "bfloat16"
    assert [s.kind for s in cfg.stages] == ["awq", "ptq_int8"]
    gptq = cfg.stages[1]
    assert gptq.algorithm == "gptq" and gptq.gptq.calibration_windows == 4 and gptq.int8_modules == ["lm_head"]
    assert cfg.data.calibration_tokens >= 4 * 512
    shape = cfg.model.config
    assert shape["num_hidden_layers"] == 3 and shape["vocab_size"] == 128256 and shape["hidden_size"] == 2048


def test_bf16_bytes_count_a_tied_head_once(cpu_scale):
    shape = dict(cpu_scale.SHAPES["llama-3.2-1b"])
    # Llama-3.2-1B: 1.236B parameters with the 128256 x 2048 table shared by embedding and head
    assert cpu_scale.bf16_bytes(shape) == pytest.approx(2 * 1.2358e9, rel=1e-3)
    untied = cpu_scale.bf16_bytes(dict(shape, tie_word_embeddings=False))
    assert untied - cpu_scale.bf16_bytes(shape) == 2 * 128256 * 2048


def test_the_table_says_whether_the_goal_is_met(cpu_scale):
    res = {"blocks": 16, "windows": 4, "threads": 2, "weights_mib": 2000.0, "wall_s": 900.0,
           "rows": [{"name": "baseline", "status": "pass", "wall_s": 20.0, "peak_rss_mb": 3000.0},
                    {"name": "1:ptq_int8", "status": "pass", "wall_s": 800.0, "peak_rss_mb": None}]}
    met = cpu_scale.table(dict(res, peak_mib=4600.0, ratio=2.3))
    assert "| baseline | pass | 20 | 3000.0 | 1.50 |" in met and "| 1:ptq_int8 | pass | | | |" in met
    assert "**4600 MiB, 2.30x**" in met and "goal <= 2.5x: met" in met
    missed = cpu_scale.table(dict(res, peak_mib=5400.0, ratio=2.7, error="exit 1: boom"))
    assert "goal <= 2.5x: NOT met" in missed and "| the run | failed: exit 1: boom |" in missed


@pytest.mark.parametrize("flag", ["--blocks", "--windows", "--threads"])
def test_a_count_below_one_is_refused_before_anything_runs(cpu_scale, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        cpu_scale.main([flag, "0"])
    assert exc.value.code == 2
    assert "--blocks, --windows and --threads must be at least 1" in capsys.readouterr().err
