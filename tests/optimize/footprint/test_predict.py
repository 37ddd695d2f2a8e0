"""Devices in the pipeline: ``device_profile`` / ``--device-profile``, the device's limits as gates
with their figures, and the decode rate predicted (and labelled so) from bandwidth."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from optimize.cli import main
from optimize.config import load_config
from optimize.errors import ConfigError
from optimize.footprint.memory import MemoryFootprint
from optimize.footprint.predict import device_gates, packed_copy_bytes, predict, weight_bytes_per_token
from device_files import device_file
from targets.devices import load_device

MIB = 2**20


def _fake_device(tmp_path, **over) -> str:
    return device_file(tmp_path, "pixel-8", "fake-device", **over)


class _Cfg:  # the config fields the KV and embedding arithmetic read
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 2, 4, 2, 64
    vocab_size = 1000


def _mem(model_rss=40 * MIB, artifact=20 * MIB) -> MemoryFootprint:
    return MemoryFootprint(artifact_bytes=artifact, peak_rss_bytes=400 * MIB + model_rss, interpreter_rss_bytes=400 * MIB,
                           model_rss_bytes=model_rss, kv_cache_bytes=1024, max_seq_len=256)


# ---- the arithmetic

def test_prediction_scales_the_host_fraction_to_the_device_bandwidth():
    dev = load_device("raspberry-pi-5")
    weights = 100 * MIB
    # the host reads 100 MiB a token at 50 tok/s out of 20 GB/s: 26% of its ceiling
    p = predict(dev, memory=_mem(), host_decode_tok_s=50.0, host_bandwidth=20e9, context_tokens=64,
                weight_bytes=weights, config=_Cfg(), max_seq_len=512)
    kv64 = 2 * 2 * 2 * 16 * 64 * 4
    frac = 50.0 * (weights + kv64) / 20e9
    assert p.host_fraction_of_ceiling == pytest.approx(frac, rel=1e-3)
    assert p.predicted_decode_tok_s == pytest.approx(frac * dev.bandwidth.practical_gb_s * 1e9 / (weights + kv64), rel=1e-3)
    assert p.predicted_decode_tok_s_at_max_seq_len < p.predicted_decode_tok_s  # a full cache reads more
    assert p.fits_memory and p.fits_storage and "predicted" in p.method
    assert any("PREDICTED" in n for n in p.notes)


def test_a_host_fraction_above_one_is_capped_and_said():
    dev = load_device("pixel-8")
    p = predict(dev, memory=None, host_decode_tok_s=5000.0, host_bandwidth=20e9, context_tokens=10,
                weight_bytes=10 * MIB, config=None, max_seq_len=None)
    assert p.host_fraction_of_ceiling > 1
    assert p.predicted_decode_tok_s == pytest.approx(dev.bandwidth.practical_gb_s * 1e9 / (10 * MIB), rel=1e-3)
    assert any("caches" in n for n in p.notes)


def test_weights_per_token_leave_out_an_embedding_stored_apart():
    pte_twice = {"weights": {"tied_embedding": "stored twice: ..."}, "quantization": {"embedding": "fp32"}}
    table = 1000 * 64 * 4
    assert weight_bytes_per_token(3 * table, _Cfg(), pte_twice, "executorch", tied=True) == 2 * table
    assert weight_bytes_per_token(3 * table, _Cfg(), {"weights": {"tied_embedding": "stored once: ..."}},
                                  "executorch", tied=True) == 3 * table
    assert weight_bytes_per_token(3 * table, _Cfg(), {}, "onnxruntime-genai", tied=True) == 3 * table  # shared
    assert weight_bytes_per_token(3 * table, _Cfg(), {}, "onnxruntime", tied=False) == 2 * table
    # ONNX Runtime: a lookup quantized over its own table (beside a per-token int8 lm_head) is apart;
    # one that shares lm_head's packed table is not
    own = {"quantization": {"embedding": "int8 per row (GatherBlockQuantized)", "matmuls": {"int8 per_token": 11}}}
    shared = {"quantization": {"embedding": "int4 shared with lm_head (GatherBlockQuantized)", "matmuls": {"x": 1}}}
    int8_table = 1000 * 64 + 1000 * 4
    assert weight_bytes_per_token(3 * table, _Cfg(), own, "onnxruntime", tied=True) == 3 * table - int8_table
    assert weight_bytes_per_token(3 * table, _Cfg(), shared, "onnxruntime-genai", tied=True) == 3 * table


def test_onnxruntime_packs_its_matmul_weights_again():
    """MLAS packs every MatMul's constant weights at load while the artifact's pages stay resident:
    the weights read per token count once more, and a tied fp32 table once more again (lm_head
    reads it transposed; docs/devices.md)."""
    table = 1000 * 64 * 4
    own = {"quantization": {"embedding": "int8 per row (GatherBlockQuantized)", "matmuls": {"int8 per_token": 11}}}
    assert packed_copy_bytes(3 * table, _Cfg(), own, "onnxruntime", tied=True) == 3 * table - (1000 * 64 + 1000 * 4)
    shared = {"quantization": {"embedding": "int4 shared with lm_head (GatherBlockQuantized)"}}
    assert packed_copy_bytes(3 * table, _Cfg(), shared, "onnxruntime-genai", tied=True) == 3 * table
    assert packed_copy_bytes(3 * table, _Cfg(), {"quantization": {"embedding": "fp32"}}, "onnxruntime", tied=True) == 4 * table
    assert packed_copy_bytes(3 * table, _Cfg(), {}, "onnxruntime", tied=False) == 2 * table  # untied: the lookup apart


def test_gates_fail_with_the_figures_and_say_predicted(tmp_path):
    dev = load_device(_fake_device(tmp_path, memory={"total_gib": 1, "usable_gib": 0.001, "usable_basis": "test"},
                                   storage_gib=0.001))
    mem = _mem()
    p = predict(dev, memory=mem, host_decode_tok_s=50.0, host_bandwidth=20e9, context_tokens=64,
                weight_bytes=100 * MIB, config=_Cfg(), max_seq_len=512)
    gates = {g.metric: g for g in device_gates(p, mem, decode_budget=1e6)}
    assert not any(g.ok for g in gates.values())
    assert "40.0 MiB" in gates["device.memory"].message and "does NOT fit" in gates["device.memory"].message
    assert "fake-device's usable memory 1.0 MiB" in gates["device.memory"].message
    assert "artifact 20.0 MiB does NOT fit" in gates["device.storage"].message
    msg = gates["device.decode_tok_s_predicted"].message
    assert msg.startswith("predicted decode on fake-device") and "misses the budget >= 1e+06" in msg
    assert "measured" not in msg.split("(")[0]  # the prediction is never called measured
    # unmeasured memory cannot pass
    p.model_rss_bytes = None
    g = device_gates(p, MemoryFootprint(error="boom"), None)[0]
    assert not g.ok and "not measured (boom)" in g.message


def test_the_memory_gate_holds_the_larger_of_measured_and_predicted(tmp_path):
    """The device's runtime build is not this host's: where the memory model predicts more than was
    measured, the prediction is what must fit (and the message says so); where it predicts less,
    the measurement decides."""
    dev = load_device(_fake_device(tmp_path, memory={"total_gib": 1, "usable_gib": 50 / 1024, "usable_basis": "test"}))
    for predicted_part, fits in ((60 * MIB, False), (30 * MIB, True)):
        mem = _mem()  # 40 MiB measured over the interpreter
        mem.predicted_peak_rss_bytes = mem.interpreter_rss_bytes + predicted_part
        p = predict(dev, memory=mem, host_decode_tok_s=None, host_bandwidth=None, context_tokens=None,
                    weight_bytes=None, config=None, max_seq_len=None)
        assert p.predicted_model_rss_bytes == predicted_part and p.fits_memory is fits
        g = device_gates(p, mem, None)[0]
        assert g.ok is fits and g.value == max(predicted_part, 40 * MIB)
        assert f"the memory model predicts {predicted_part / MIB:.1f} MiB" in g.message
        assert ("the larger" in g.message) is (not fits)


# ---- the config and the CLI

def test_device_profile_in_the_config_and_its_errors(tiny_cfg, tmp_path):
    tiny_cfg["target"] = "executorch"
    assert load_config(dict(tiny_cfg, device_profile="raspberry-pi-5")).device_profile == "raspberry-pi-5"
    assert load_config(tiny_cfg, device_profile="pixel-8").device_profile == "pixel-8"
    with pytest.raises(ConfigError) as err:
        load_config(dict(tiny_cfg, device_profile="pixel-99"))
    assert "device_profile: unknown device profile 'pixel-99'; available: android-midrange-6gb" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(dict(tiny_cfg, target="torchchat", device_profile="pixel-8"))
    assert "device 'pixel-8' does not run target 'torchchat'; it runs: executorch, onnxruntime" in str(err.value)
    # a file path, relative to the pipeline YAML
    _fake_device(tmp_path)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(dict(tiny_cfg, device_profile="fake-device.yaml")))
    cfg = load_config(tmp_path / "p.yaml")
    assert cfg.device_profile == str(tmp_path / "fake-device.yaml")


def test_cli_ls_devices_and_the_flag(tiny_cfg, tmp_path, capsys):
    assert main(["ls", "devices"]) == 0
    out = capsys.readouterr().out
    for name in ("pixel-8", "galaxy-s24", "iphone-15-pro", "android-midrange-6gb", "raspberry-pi-5",
                 "jetson-orin-nano", "host"):
        assert re.search(rf"^{re.escape(name)}\s+\d", out, re.M), name
    assert re.search(r"^raspberry-pi-5\s+8\s+7\s+17\.1\s+0\.6\s+4\s+executorch, onnxruntime, torchchat", out, re.M)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["validate", str(path), "--target", "onnxruntime", "--device-profile", "galaxy-s24"]) == 0
    assert "device: galaxy-s24" in capsys.readouterr().out
    assert main(["validate", str(path), "--device-profile", "nokia-3310"]) == 2
    err = capsys.readouterr().err
    assert "unknown device profile 'nokia-3310'" in err and "raspberry-pi-5" in err
    from optimize.cli import build_parser

    args = build_parser().parse_args(["pipeline", str(path), "--device-profile", "pixel-8", "seed=1"])
    assert args.device_profile == "pixel-8" and args.overrides == ["seed=1"]


# ---- the pipeline

@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_export_rows_report_memory_and_a_device_that_does_not_fit_fails_with_figures(tiny_cfg, tmp_path):
    """A fake device with 1 MiB usable and 1 MiB of storage and a decode budget of a million tokens a
    second: the ONNX export row fails all three device gates, each with its figures; report.json and
    report.md carry the measured memory and the prediction, labelled predicted."""
    from optimize import run_pipeline

    dev = _fake_device(tmp_path, memory={"total_gib": 1, "usable_gib": 0.001, "usable_basis": "test"},
                       storage_gib=0.001, budgets={"decode_tok_s": 1e6})
    tiny_cfg.update(target="onnxruntime", export={"onnxruntime": {"max_seq_len": 128}})
    tiny_cfg["checks"]["generate_tokens"] = 0
    tiny_cfg["checks"]["memory"] = True  # what this test is about (tiny_cfg leaves it off)
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None, device_profile=dev)
    row = report.row("export:onnxruntime")
    assert row.status == "fail" and not report.ok
    assert report.row("export:onnxruntime:genai").metrics.memory.model_rss_bytes > 0  # every artifact
    mem = row.metrics.memory
    assert mem.artifact_bytes > 10 * MIB and mem.kv_cache_bytes == 2 * 2 * 2 * 16 * 128 * 4
    assert mem.peak_rss_bytes > mem.interpreter_rss_bytes and mem.model_rss_bytes > mem.artifact_bytes
    gates = {g.metric: g for g in row.gates}
    assert not gates["device.memory"].ok and "does NOT fit fake-device's usable memory 1.0 MiB" in gates["device.memory"].message
    assert not gates["device.storage"].ok and "storage budget 1.0 MiB" in gates["device.storage"].message
    assert not gates["device.decode_tok_s_predicted"].ok and "predicted" in gates["device.decode_tok_s_predicted"].message
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    dev_json = next(r for r in saved["rows"] if r["name"] == row.name)["metrics"]["device"]
    assert dev_json["predicted_decode_tok_s"] > 0 and "predicted" in dev_json["method"]
    assert dev_json["host_decode_tok_s"] == row.metrics.decode_tok_s
    assert "measured_decode" not in json.dumps(dev_json)
    assert saved["device_profile"]["name"] == "fake-device"
    md = (tmp_path / "run" / "report.md").read_text()
    assert "## Memory of the exported artifacts (measured on this host)" in md
    # the prediction's terms, summing to the predicted peak
    assert sum(mem.predicted_parts.values()) == mem.predicted_peak_rss_bytes and mem.predicted_parts["kv_cache"] > 0
    assert f"- {row.name}: interpreter " in md and "kv_cache" in md
    assert "## Device `fake-device` (phone): fit and PREDICTED decode" in md and "decode tok/s (predicted)" in md
    assert "Method (predicted, not measured on the device)" in md and "does NOT fit" in md


def test_one_recipes_efficiency_predicts_anothers_decode():
    from optimize.footprint.predict import DevicePrediction, predict_from_another

    common = dict(device="host", kind="host", usable_memory_bytes=2**33, storage_bytes=2**35, device_bandwidth_gb_s=10.0)
    src = DevicePrediction(**common, host_bandwidth_gb_s=10.0, host_fraction_of_ceiling=0.5,
                           weight_bytes_per_token=50_000_000, kv_bytes_per_token=0)
    dst = DevicePrediction(**common, host_bandwidth_gb_s=10.0, weight_bytes_per_token=90_000_000,
                           kv_bytes_per_token=10_000_000, host_decode_tok_s=48.0)
    assert predict_from_another(src, dst) == 50.0  # 0.5 x 10 GB/s / 100 MB
    capped = src.model_copy(update={"host_fraction_of_ceiling": 1.7})  # weights in cache: capped at the ceiling
    assert predict_from_another(capped, dst) == 100.0
    assert predict_from_another(dst, src) is None  # the source has no measured fraction


def test_the_nearest_source_is_the_most_alike_precision_mix():
    """The bench's three SmolLM2 recipes (MiB per token by precision): the demo (int4 body, int8 head)
    is nearest to the int4 body with an fp32 head, not to the int8 one; a source without a measured
    fraction is never chosen; without the split there is no overlap."""
    from optimize.footprint.predict import DevicePrediction, nearest_source, precision_overlap

    common = dict(device="host", kind="host", usable_memory_bytes=2**33, storage_bytes=2**35, device_bandwidth_gb_s=10.0)

    def recipe(fraction=None, **mib):
        return DevicePrediction(**common, host_fraction_of_ceiling=fraction,
                                weight_bytes_by_scheme={k: v * 2**20 for k, v in mib.items()})

    demo = recipe(**{"8da8w": 27, "8da4w": 63})
    int8 = recipe(0.90, fp32=108, **{"8da8w": 102})
    int4 = recipe(0.78, fp32=108, **{"8da4w": 63})
    assert precision_overlap(demo, demo) == 1.0 and precision_overlap(demo, int8) == pytest.approx(0.3, abs=1e-3)
    assert precision_overlap(demo, int4) == pytest.approx(63 / 171, abs=1e-3)
    assert precision_overlap(int4, int8) == pytest.approx(108 / 210, abs=1e-3)  # both fp32 heads
    assert nearest_source(demo, [int8, int4]) is int4 and nearest_source(int4, [demo, int8]) is int8
    measured_demo = recipe(0.75, **{"8da8w": 27, "8da4w": 63})
    twin = recipe(None, fp32=108, **{"8da8w": 102})  # the same mix, but not measured: never the source
    assert nearest_source(int8, [measured_demo, twin]) is measured_demo
    assert nearest_source(demo, [recipe(None, fp32=1)]) is None
    assert precision_overlap(demo, DevicePrediction(**common)) is None


def test_bytes_by_scheme_reads_the_exported_graph_record(tiny_llama_config):
    """The majority scheme for every Linear not listed under another scheme; int8 and int4 at their
    scale overheads, fp32 at 4 bytes a weight; a row without the graph record (another runtime) has
    no split."""
    from transformers import AutoConfig

    from optimize.footprint.predict import bytes_by_scheme

    config = AutoConfig.for_model(**tiny_llama_config)
    h, v, inter, layers = (tiny_llama_config[k] for k in ("hidden_size", "vocab_size", "intermediate_size",
                                                          "num_hidden_layers"))
    details = {"quantization": {"exported_linear": {"counts": {"8da4w": 7 * layers, "fp32": 1},
                                                    "majority": "8da4w", "modules": {"fp32": ["lm_head"]}}}}
    split = bytes_by_scheme(config, details)
    assert set(split) == {"8da4w", "fp32"} and split["fp32"] == 4 * v * h
    kv = tiny_llama_config["num_key_value_heads"] * h // tiny_llama_config["num_attention_heads"]
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    assert split["8da4w"] == pytest.approx(body * (0.5 + 4 / 32), rel=1e-6)
    assert bytes_by_scheme(config, {"quantization": {"linear": {"8da8w": 3}}}) is None


def test_a_memory_check_that_cannot_measure_fails_its_gate(tiny_cfg, monkeypatch):
    """Without a device profile too: a child that could not measure (a full-context prefill asking
    for more memory than the machine has, as a 262k-vocabulary head's logits did) fails the row's
    ``memory`` gate, naming why, instead of the run ending "all gates passed" without the figure."""
    from optimize import run_pipeline
    from optimize.footprint.memory import MemoryFootprint

    why = "the memory child exited -6 without figures: std::bad_alloc"
    monkeypatch.setattr("optimize.export_rows.footprint", lambda path, *a, **k: MemoryFootprint(error=why))
    tiny_cfg.update(target="onnxruntime", export={"onnxruntime": {"max_seq_len": 128}})
    tiny_cfg["checks"].update(generate_tokens=0, memory=True)
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert not report.ok
    row = report.row("export:onnxruntime")
    gate = next(g for g in row.gates if g.metric == "memory")
    assert row.status == "fail" and not gate.ok and gate.value is None
    assert gate.message == f"peak memory was not measured ({why}); checks.memory: false skips the check"


def test_no_memory_gate_where_it_was_measured_or_not_asked_for():
    from types import SimpleNamespace

    from optimize.export_rows import _memory_gate
    from optimize.footprint.memory import MemoryFootprint

    def state(memory: bool):
        return SimpleNamespace(cfg=SimpleNamespace(checks=SimpleNamespace(memory=memory)))

    def row(mem):
        return SimpleNamespace(metrics=SimpleNamespace(memory=mem))

    measured = MemoryFootprint(artifact_bytes=1, peak_rss_bytes=2)
    assert _memory_gate(state(True), row(measured)) == []
    assert _memory_gate(state(False), row(MemoryFootprint(error="boom"))) == []
    assert _memory_gate(state(False), row(None)) == []
    assert [g.ok for g in _memory_gate(state(True), row(None))] == [False]
