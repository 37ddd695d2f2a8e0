"""bench/et_profile.py: an ETDump of a forward, grouped into GEMMs, delegate overhead and kernels."""

from __future__ import annotations

import pytest

from tests.bench.conftest import load_bench_script


@pytest.fixture(scope="module")
def et_profile():
    yield from load_bench_script("et_profile")


def test_group_call_attributes_wrappers_to_what_they_wrap(et_profile):
    """XNNPACK ops precede their DELEGATE_CALL; a kernel's own event precedes its OPERATOR_CALL."""
    events = [
        ("Fully Connected (NC, QDU8, F32, QB4W) GEMM #1", True, 0.010),
        ("Multiply (ND) #1", True, 0.001),
        ("DELEGATE_CALL", False, 0.015),  # 0.004 of it outside the two ops
        ("llama::update_cache.out", False, 0.0005),
        ("OPERATOR_CALL", False, 0.001),
        ("llama::custom_sdpa.out", False, 0.020),
        ("OPERATOR_CALL", False, 0.021),
        ("OPERATOR_CALL", False, 0.0003),  # a kernel that logs no event of its own
        ("Fully Connected (NC, F32) GEMM #1", True, 0.002),
        ("DELEGATE_CALL", False, 0.002),  # no overhead: never negative
        ("Method::execute", False, 0.045),
    ]
    g = et_profile.group_call(events)
    assert g["xnnpack_gemm"] == pytest.approx(0.012) and g["n_xnnpack_gemm"] == 2
    assert g["xnnpack_other"] == pytest.approx(0.001)
    assert g["delegate_calls"] == pytest.approx(0.017) and g["n_delegate_calls"] == 2
    assert g["delegate_overhead"] == pytest.approx(0.004)
    assert g["custom_sdpa"] == pytest.approx(0.021) and g["n_custom_sdpa"] == 1
    assert g["update_cache"] == pytest.approx(0.001)
    assert g["portable_kernels"] == pytest.approx(0.0003) and g["n_portable_kernels"] == 1
    assert g["runtime_glue"] == pytest.approx(0.045 - 0.017 - 0.021 - 0.001 - 0.0003)


def test_breakdown_is_the_median_over_calls(et_profile):
    rows = et_profile.breakdown([{"execute": 1.0, "custom_sdpa": 0.2}, {"execute": 3.0}, {"execute": 2.0}])
    assert rows == {"custom_sdpa": 0.0, "execute": 2.0}


@pytest.mark.slow
def test_profile_of_a_tiny_program(et_profile, tiny_llama, tmp_path):
    """A real 2-layer program: one custom_sdpa and two cache updates per layer per call, GEMMs
    inside XNNPACK, and rows that add up to the call (within the runtime's own glue)."""
    from export.executorch.exporter import ExecuTorchOptions, lower_to_pte

    class Tok:
        bos_token_id, eos_token_id, vocab_file = 1, 2, ""

    data, _ = lower_to_pte(tiny_llama, Tok(), ExecuTorchOptions(max_seq_len=64), log=lambda *_: None)
    pte = tmp_path / "model.pte"
    pte.write_bytes(data)
    res = et_profile.profile(pte, tokens=1, position=10, calls=4, threads=1)
    assert res["prefill_calls"] == 1  # the 10 cached positions are filled before the timed calls
    assert et_profile.profile(pte, tokens=1, position=0, calls=2, threads=1)["prefill_calls"] == 0
    ms = res["ms"]
    layers = tiny_llama.config.num_hidden_layers
    assert ms["n_custom_sdpa"] == layers and ms["n_update_cache"] == 2 * layers
    assert ms["n_xnnpack_gemm"] >= 7 * layers  # q, k, v, o, gate, up, down per layer
    assert ms["execute"] > 0 and ms["xnnpack_gemm"] > 0
    parts = ms["delegate_calls"] + ms["custom_sdpa"] + ms["update_cache"] + ms["portable_kernels"]
    assert parts <= ms["execute"] * 1.001  # medians of parts may not sum exactly; none exceeds the call
    assert "XNNPACK GEMMs" in et_profile.table([res])
    with pytest.raises(FileNotFoundError, match="no .pte at"):
        et_profile.profile(tmp_path / "missing.pte")
