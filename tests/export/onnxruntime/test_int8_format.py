"""u8s8 against u8u8: the saturation detector agrees with what ONNX Runtime computes on this CPU,
u8u8 is exact on every CPU, and ``int8_format`` resolves, validates and warns as documented."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError

from export.onnxruntime import int8_format as fmt
from export.onnxruntime.exporter import OnnxRuntimeOptions
from export.onnxruntime.quant import integer_weight

M, K, N = 32, 256, 64


def _matmul_integer(w: np.ndarray, unsigned: bool) -> ort.InferenceSession:
    g = helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [M, K])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, [M, N])])
    inputs = integer_weight(g, w, "w", unsigned)
    g.node.append(helper.make_node("MatMulInteger", ["x", *inputs], ["y"]))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_u8u8_is_exact_and_the_detector_matches_u8s8_on_this_cpu():
    """Full-range uint8 activations against int8 weights: the integer product is known exactly.
    u8u8 must equal it here; u8s8 is wrong exactly where ``host_u8s8_saturates`` says so."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (M, K), dtype=np.uint8)
    w = rng.integers(-127, 128, (K, N)).astype(np.int8)
    want = x.astype(np.int64) @ w.astype(np.int64)
    u8u8 = _matmul_integer(w, unsigned=True).run(None, {"x": x})[0]
    np.testing.assert_array_equal(u8u8, want)
    u8s8 = _matmul_integer(w, unsigned=False).run(None, {"x": x})[0]
    wrong = float((u8s8 != want).mean())
    assert (wrong > 0.5) == fmt.host_u8s8_saturates(), (wrong, fmt.host_u8s8_saturates())
    assert wrong == 0.0 or wrong > 0.5  # either exact, or saturated almost everywhere (measured 0.99)


def test_uint8_storage_is_the_int8_grid_shifted():
    g = helper.make_graph([], "g", [], [])
    w = np.array([[-127, 0], [5, 127]], np.int8)
    assert integer_weight(g, w, "a", unsigned=False) == ["a.w_int8"]
    assert integer_weight(g, w, "b", unsigned=True) == ["b.w_uint8", "", "b.w_zero_point"]
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    assert inits["a.w_int8"].dtype == np.int8 and inits["b.w_uint8"].dtype == np.uint8
    np.testing.assert_array_equal(inits["b.w_uint8"].astype(np.int16) - inits["b.w_zero_point"], w)
    assert inits["b.w_zero_point"].tolist() == [128, 128]


@pytest.mark.parametrize("isa,machine,want", [
    (["avx2", "fma"], "x86_64", "u8u8"),                      # AVX2 without VNNI (Zen 2/3, Haswell..Coffee Lake)
    (["avx2", "avx512f"], "x86_64", "u8u8"),                  # Skylake-X: AVX-512 but no VNNI
    (["avx2", "avx512f", "avx512_vnni"], "x86_64", "u8s8"),   # Cascade Lake and later, Zen 4
    (["avx2", "avx_vnni"], "x86_64", "u8s8"),                 # Alder Lake
    (["neon", "dotprod"], "aarch64", "u8s8"),                 # phones, Raspberry Pi 5
    ([], "aarch64", "u8s8"),
])
def test_auto_resolves_by_the_cpu(isa, machine, want):
    got = fmt.resolve_int8_format("auto", isa, machine)
    assert got["format"] == want and got["why"].startswith("auto: the device profile's CPU"), got
    assert fmt.resolve_int8_format(want if want == "u8s8" else "u8u8", isa, machine) == {
        "format": want, "why": "set by int8_format"}


def test_auto_without_a_profile_asks_this_host():
    got = fmt.resolve_int8_format("auto")
    assert got["format"] == ("u8u8" if fmt.host_u8s8_saturates() else "u8s8")
    assert "this host's CPU" in got["why"]


def test_option_validation():
    with pytest.raises(ValidationError, match="'auto', 'u8s8' or 'u8u8'"):
        OnnxRuntimeOptions(int8_format="s8s8")
    with pytest.raises(ValidationError, match="reduce_range .* is the u8s8 saturation workaround"):
        OnnxRuntimeOptions(quantize="dynamic", graph="dynamo", reduce_range=True, int8_format="u8u8")
    assert OnnxRuntimeOptions(quantize="dynamic", graph="dynamo", reduce_range=True).int8_format == "auto"


def test_loading_u8s8_on_a_saturating_cpu_warns(monkeypatch):
    monkeypatch.setattr(fmt, "host_u8s8_saturates", lambda: True)
    with pytest.warns(RuntimeWarning, match="u8s8.*saturating 16-bit sums.*int8_format: u8u8"):
        assert fmt.warn_if_saturates("u8s8", "model.onnx")
    assert not fmt.warn_if_saturates("u8u8", "model.onnx")
    assert not fmt.warn_if_saturates(None, "model.onnx")  # fp32, or a manifest from before the key
    monkeypatch.setattr(fmt, "host_u8s8_saturates", lambda: False)
    assert not fmt.warn_if_saturates("u8s8", "model.onnx")


def test_a_pipeline_device_profile_decides_auto():
    """for_run (the pipeline's hook) resolves auto against the device profile's CPU: a phone is
    arm64 (u8s8 whatever this host is); ``host`` and no profile leave it to this host."""
    from types import SimpleNamespace

    opts = OnnxRuntimeOptions(quantize="dynamic_per_token")
    phone = opts.for_run(SimpleNamespace(device_profile="pixel-8"), "export:onnxruntime")
    assert phone.resolved_int8_format() == {
        "format": "u8s8", "why": "auto: device profile 'pixel-8' (aarch64) runs u8 x s8 without saturation"}
    assert opts.resolved_int8_format() == fmt.resolve_int8_format("auto")
    for device in ("host", None):
        assert opts.for_run(SimpleNamespace(device_profile=device), "x") is opts
    fixed = OnnxRuntimeOptions(int8_format="u8u8")
    assert fixed.for_run(SimpleNamespace(device_profile="pixel-8"), "x").resolved_int8_format()["format"] == "u8u8"


def test_genai_runner_warns_on_a_u8s8_directory(tmp_path, monkeypatch):
    """onnxruntime-genai runs the same MatMulInteger kernels: its runner warns like the plain one,
    from our manifest; a directory without one (the model builder's) is not warned about."""
    import json
    import warnings

    from export.onnxruntime import genai_runner

    monkeypatch.setattr(fmt, "host_u8s8_saturates", lambda: True)
    monkeypatch.setattr(genai_runner, "_load_model", lambda d, t, **_: (object(), {"search": {"max_length": 64}}))
    (tmp_path / "manifest.json").write_text(json.dumps({"quantization": {"int8_format": {"format": "u8s8"}}}))
    with pytest.warns(RuntimeWarning, match="u8s8.*saturating"):
        genai_runner.GenaiRunner(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"quantization": {"int8_format": {"format": "u8u8"}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        genai_runner.GenaiRunner(tmp_path)
        (tmp_path / "manifest.json").unlink()
        genai_runner.GenaiRunner(tmp_path)
