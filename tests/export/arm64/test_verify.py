"""Artifacts run in the ARM64 builds of their runtimes under QEMU, against the x86-64 builds.

The slow tests build the ARM64 environment (tests/conftest.py ``arm64_env``) and run a tiny
8da4w ``.pte`` (the demo's scheme: XNNPACK's Arm int8 kernels) on an emulated Cortex-A76 (the
Raspberry Pi 5's core) and on QEMU's Armv9 ``max`` (phone cores), where it must verify, and on a
Cortex-A72 (the Raspberry Pi 4's Armv8.0 core), where ExecuTorch's LLM custom ops die of SIGILL:
the fact behind the Pi 4 refusal in targets/profiles/executorch.yaml. The ONNX side runs through
the pipeline in tests/optimize/checks/test_arm64.py and through ``optimize verify`` here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from export.arm64.verify import Arm64VerifyError, _divergence, verify_on_arm64

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, tie_word_embeddings=True,
            rope_theta=100000.0, initializer_range=0.2)
IDS = [(i * 97 + 11) % 49152 for i in range(300)]
PROMPTS = [IDS[:8], IDS[50:60]]
WINDOWS = [IDS[100:165], IDS[200:265]]


def test_divergence_is_accepted_only_at_a_near_tie():
    steps = np.zeros((3, 5), dtype=np.float32)
    steps[1, 2], steps[1, 4] = 1.0, 0.99  # host picks 2 over 4 by 0.01
    assert _divergence([1, 2, 3], [1, 2, 3], steps, tie=0.1) == {"equal": True, "first_divergence": None}
    tie = _divergence([1, 2, 3], [1, 4, 0], steps, tie=0.05)
    assert tie["first_divergence"] == 1 and tie["near_tie"] and tie["host_gap"] == pytest.approx(0.01, abs=1e-6)
    assert not _divergence([1, 2, 3], [1, 4, 0], steps, tie=0.005)["near_tie"]
    assert _divergence([1, 2], [1, 2, 3], steps, tie=0.1)["equal"] is False  # a run that stopped early


def test_the_perplexity_comparison_states_its_standard_error():
    """Two builds of a 4-bit model land a few percent apart window by window, either way: the report gives
    the standard error of the difference over the windows, from that spread (here 0.05 nats/token a window
    over 16 windows of 128: about 1.25%, so 8 windows would be +-1.8% and 24 about +-1%)."""
    from export.arm64.verify import _paired_se_pct

    rng = np.random.default_rng(0)
    host = list(3.0 * 128 + rng.normal(0, 1, 16))
    spread = rng.normal(0, 0.05 * 128, 16)
    guest = [h + d for h, d in zip(host, spread)]
    se = _paired_se_pct(host, guest, 16 * 128)
    assert se == pytest.approx(100 * np.expm1(np.std(spread, ddof=1) / np.sqrt(16) / 128), rel=1e-3)
    assert 0.8 < se < 1.8
    assert _paired_se_pct(host, host, 16 * 128) == 0.0
    assert _paired_se_pct(host[:1], guest[:1], 128) is None and _paired_se_pct(None, guest, 128) is None


def test_the_summary_says_which_build_is_worse():
    """The gate reads the difference's size; the line a user reads keeps its sign (the ARM64 build
    better is not the same finding as worse)."""
    from export.arm64.verify import summary

    report = {"artifact": "/x/model.pte", "runtime": "executorch", "where": "aarch64 (emulated, max)", "core": "max",
              "greedy": [], "host": {"greedy": []}, "verified": True, "logits": {"max_abs_diff_pct_of_scale": 7.9},
              "perplexity": {"host": 25.5798, "guest": 25.5464, "rel_diff_pct": 0.1306, "se_pct": 0.28, "windows": 24,
                             "tolerance_pct": 1.0}}
    assert "(-0.131% ± 0.28% standard error over 24 windows" in summary(report)
    report["perplexity"]["guest"] = 25.6801
    assert "(+0.392% ±" in summary(report)


def test_the_checks_windows_are_cut_in_order_from_the_evaluation_windows():
    import torch

    from optimize.checks.arm64 import _cut

    evals = [torch.arange(0, 513), torch.arange(513, 1026)]
    wins = _cut(evals, 128, 6)
    assert len(wins) == 6 and all(len(w) == 129 for w in wins)
    assert wins[0][:2] == [0, 1] and wins[3][-1] == 512 and wins[4][0] == 513  # four a window of 512, then the next
    assert len(_cut(evals, 128, 100)) == 8


def test_bad_requests_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        verify_on_arm64(tmp_path / "nope.pte", prompts=[[1]], windows=[])
    (tmp_path / "m.pte").write_bytes(b"x")
    with pytest.raises(Arm64VerifyError, match="either cpu or device"):
        verify_on_arm64(tmp_path / "m.pte", prompts=[[1]], windows=[], cpu="cortex-a76", device="raspberry-pi-5")
    with pytest.raises(Arm64VerifyError, match="nothing to compare"):
        verify_on_arm64(tmp_path / "m.pte", prompts=[], windows=[])
    with pytest.raises(Arm64VerifyError, match="unknown CPU"):
        verify_on_arm64(tmp_path / "m.pte", prompts=[[1]], windows=[], cpu="cortex-a9")


@pytest.fixture(scope="module")
def tiny():
    from targets.sources import RandomSource, load_model

    return load_model(RandomSource(config=dict(TINY), seed=0))


@pytest.fixture()
def tiny_pte(tiny, tmp_path):
    from export.executorch.exporter import ExecuTorchExporter

    return ExecuTorchExporter().export(tiny.model, tiny.tokenizer, tmp_path / "et", {"max_seq_len": 64, "quantize": "8da4w"},
                                       log=lambda *a: None).artifact


@pytest.fixture()
def tiny_onnx(tiny, tmp_path):
    from export.onnxruntime.exporter import OnnxRuntimeExporter

    return OnnxRuntimeExporter().export(tiny.model, tiny.tokenizer, tmp_path / "ort", {"max_seq_len": 64, "quantize": "dynamic"},
                                        log=lambda *a: None).artifact


@pytest.mark.slow
@pytest.mark.minutes(2)
def test_pte_verifies_on_a76_and_armv9_and_dies_of_sigill_on_the_pi4_core(arm64_env, tiny_pte):
    pte = tiny_pte
    for cpu in ("cortex-a76", "max"):
        rep = verify_on_arm64(pte, prompts=PROMPTS, windows=WINDOWS, new_tokens=8, cpu=cpu)
        assert rep["verified"], rep
        assert rep["guest"]["machine"] == "aarch64" and rep["where"].startswith(f"aarch64 (emulated, {cpu}")
        # XNNPACK's Arm kernels are other code than its x86 ones: the logits differ, a little
        assert 0 < rep["logits"]["max_abs_diff_pct_of_scale"] < 15
        assert rep["perplexity"]["rel_diff_pct"] <= 1.0
        for d in rep["greedy"]:  # equal, or first diverging at a gap below the builds' own noise
            assert d["equal"] or d["host_gap"] <= d["tie_threshold"]
        json.dumps(rep)
    bad = verify_on_arm64(pte, prompts=PROMPTS[:1], windows=[], new_tokens=4, device="raspberry-pi-4")
    assert bad["verified"] is False and bad["cpu"] == "cortex-a72"
    assert "SIGILL" in bad["failure"] and "cortex-a72 (armv8-a)" in bad["failure"]


@pytest.mark.slow
@pytest.mark.minutes(1.3)
def test_optimize_verify_cli(arm64_env, tiny_onnx, capsys, tmp_path):
    from optimize.cli import main

    onnx = tiny_onnx
    out = tmp_path / "rep.json"
    assert main(["verify", str(onnx), "--cpu", "cortex-a72", "--prompts", "1", "--new-tokens", "4",
                 "--windows", "1", "--window-tokens", "32", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verified on aarch64 (emulated, cortex-a72)" in text and "perplexity" in text
    rep = json.loads(out.read_text())
    assert rep["runtime"] == "onnxruntime" and rep["verified"] and rep["guest"]["machine"] == "aarch64"
    assert main(["verify", str(onnx), "--cpu", "cortex-a7"]) == 2
    assert "unknown CPU 'cortex-a7'" in capsys.readouterr().err
