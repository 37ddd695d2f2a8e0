"""The shared exactness check behind smoothquant, awq and rmsnorm: passes a true fold, refuses
a changed model naming the fold, the difference and the tolerance."""

from __future__ import annotations

import pytest
import torch

from optimize.rewrites.exactness import (
    DEFAULT_TOLERANCE,
    MAX_SCALED_TOLERANCE,
    ExactnessConfig,
    ExactnessProbe,
    FoldNotExact,
    probe_windows,
    scaled_tolerance,
)


def _windows():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (40,), generator=g) for _ in range(3)]


def test_unchanged_model_passes_and_reports(tiny_llama):
    cfg = ExactnessConfig(windows=2, tokens=16)
    wins = probe_windows(_windows(), cfg)
    assert [w.numel() for w in wins] == [16, 16]
    probe = ExactnessProbe.before(tiny_llama, wins, cfg)
    facts = probe.after(tiny_llama, "nothing")
    assert facts["max_abs_logit_diff"] == 0.0 and facts["relative_diff"] == 0.0
    assert facts["tolerance"] == DEFAULT_TOLERANCE and facts["tokens"] == 32 and facts["logit_scale"] > 0


def test_changed_model_is_refused_with_the_figures(tiny_llama):
    cfg = ExactnessConfig(windows=1, tokens=16)
    probe = ExactnessProbe.before(tiny_llama, probe_windows(_windows(), cfg), cfg)
    with torch.no_grad():
        tiny_llama.model.layers[0].input_layernorm.weight.mul_(1.5)  # a fold that forgot its other half
    with pytest.raises(FoldNotExact, match=r"smoothquant \(folds qkv\) is not exact on this model: logits moved by "
                                           r"up to [0-9.e-]+ \(relative to the largest logit [0-9.e-]+: [0-9.e-]+\) on 16 "
                                           r"calibration tokens, above the tolerance 0.0001"):
        probe.after(tiny_llama, "smoothquant (folds qkv)")


def test_rounding_sized_change_passes(tiny_llama):
    """A perturbation the size of fp32 rounding of every weight is within the default tolerance."""
    cfg = ExactnessConfig(windows=1, tokens=16)
    probe = ExactnessProbe.before(tiny_llama, probe_windows(_windows(), cfg), cfg)
    with torch.no_grad():
        for p in tiny_llama.parameters():
            p.mul_(1 + torch.finfo(torch.float32).eps * torch.randn_like(p).sign())
    assert probe.after(tiny_llama, "rounding")["relative_diff"] < DEFAULT_TOLERANCE / 10


def test_windows_fall_back_to_text_then_to_fixed_ids():
    cfg = ExactnessConfig(windows=2, tokens=8)
    text = torch.arange(100)
    assert [w.tolist() for w in probe_windows([], cfg, fallback=text)] == [list(range(8)), list(range(8, 16))]
    (fixed,) = probe_windows([], cfg, vocab=50)
    assert fixed.numel() == 8 and int(fixed.max()) < 50
    assert torch.equal(fixed, probe_windows([], cfg, vocab=50)[0])  # deterministic


def test_low_precision_scales_the_tolerance():
    assert scaled_tolerance(1e-4, torch.float32) == 1e-4
    assert scaled_tolerance(1e-6, torch.float16) == pytest.approx(1e-6 * 2**13)
    assert scaled_tolerance(1e-4, torch.bfloat16) == MAX_SCALED_TOLERANCE


@pytest.mark.parametrize("kind", ["smoothquant", "awq", "rmsnorm"])
@pytest.mark.parametrize(
    "value,message",
    [
        ({"tolerance": 0}, r"exactness\.tolerance: Input should be greater than 0"),
        ({"tolerance": 2}, r"exactness\.tolerance: Input should be less than or equal to 1"),
        ({"windows": 0}, r"exactness\.windows: Input should be greater than or equal to 1"),
        ({"tokens": 4}, r"exactness\.tokens: Input should be greater than or equal to 8"),
        ({"tolerence": 1e-3}, r"exactness\.tolerence: unknown key 'tolerence'.*did you mean 'tolerance'"),
        (1e-4, r"exactness: Input should be a valid dictionary or instance of ExactnessConfig"),
    ],
)
def test_bad_exactness_values_name_the_yaml_path(tiny_cfg, kind, value, message):
    from optimize import load_config
    from optimize.errors import ConfigError

    tiny_cfg["stages"] = [{"kind": kind, "exactness": value}]
    with pytest.raises(ConfigError, match=r"stages\.0\." + message):
        load_config(tiny_cfg, check_model=False)
