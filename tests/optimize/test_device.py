"""The run's device and compute dtype: validated with their YAML path, ``auto`` resolved, ``cuda``
refused in one line where there is none, and the model placed without losing what it holds."""

from __future__ import annotations

import collections

import pytest
import torch
from cuda_marks import needs_cuda  # tests/optimize is on sys.path (its conftest)

from optimize.config import load_config
from optimize.device import DeviceError, floating_dtype, model_device, on_device, place, resolve_device, to_device
from optimize.errors import ConfigError


@pytest.fixture()
def no_cuda(monkeypatch):
    """This machine as one without CUDA (the CPU CI already is; a GPU box pretends)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("device", ["auto", "cpu"])
@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16", "float16"])
def test_good_values_load(tiny_cfg, device, dtype):
    tiny_cfg.update(device=device, compute_dtype=dtype)
    cfg = load_config(tiny_cfg)
    assert (cfg.device, cfg.compute_dtype) == (device, dtype)


def test_defaults_are_auto_and_the_loaded_dtype(tiny_cfg):
    cfg = load_config(tiny_cfg)
    assert cfg.device == "auto" and cfg.compute_dtype is None


@pytest.mark.parametrize("key,value,allowed", [
    ("device", "gpu", "'auto', 'cpu' or 'cuda'"),
    ("device", "cuda:1", "'auto', 'cpu' or 'cuda'"),
    ("compute_dtype", "fp16", "'float32', 'bfloat16' or 'float16'"),
])
def test_wrong_values_name_their_yaml_path_and_the_choices(tiny_cfg, key, value, allowed):
    tiny_cfg[key] = value
    with pytest.raises(ConfigError) as info:
        load_config(tiny_cfg)
    assert f"{key}: Input should be {allowed} (got {value!r})" in str(info.value)


def test_cuda_without_cuda_is_refused_in_one_line(tiny_cfg, no_cuda):
    tiny_cfg["device"] = "cuda"
    with pytest.raises(DeviceError) as info:
        load_config(tiny_cfg)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("<config>: device: cuda") and "use device: auto or cpu" in msg
    # a config error like any other, at the YAML path of the key
    assert isinstance(info.value, ConfigError) and [p for p, _ in info.value.problems] == ["device"]


def test_validate_refuses_cuda_without_cuda_with_one_line_and_exit_2(tiny_cfg, tmp_path, no_cuda, capsys):
    import yaml

    from optimize.cli import main

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg))
    assert main(["validate", str(path), "device=cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "device: cuda" in err[0], err
    assert main(["validate", str(path), "device=auto"]) == 0  # the same file runs where auto picks the CPU


def test_auto_resolves_to_the_cpu_without_cuda(no_cuda):
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(DeviceError, match="device: cuda"):
        resolve_device("cuda")


def test_auto_on_this_machine():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want


def test_place_casts_parameters_keeps_fp32_buffers_and_ties(tiny_llama):
    assert floating_dtype(tiny_llama) == torch.float32
    inv_freq = dict(tiny_llama.named_buffers())["model.rotary_emb.inv_freq"]
    place(tiny_llama, torch.device("cpu"), torch.bfloat16)
    assert floating_dtype(tiny_llama) == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in tiny_llama.parameters())
    assert dict(tiny_llama.named_buffers())["model.rotary_emb.inv_freq"].dtype == torch.float32 == inv_freq.dtype
    assert tiny_llama.lm_head.weight is tiny_llama.model.embed_tokens.weight  # still one tied parameter
    place(tiny_llama, torch.device("cpu"), torch.float32)
    assert floating_dtype(tiny_llama) == torch.float32 and tiny_llama.lm_head.weight is tiny_llama.model.embed_tokens.weight


def test_place_leaves_a_model_that_is_already_there_untouched(tiny_llama):
    before = {n: p for n, p in tiny_llama.named_parameters()}
    place(tiny_llama, torch.device("cpu"), torch.float32)
    place(tiny_llama, torch.device("cpu"), None)
    assert all(p is before[n] for n, p in tiny_llama.named_parameters())


def test_to_device_moves_every_tensor_in_recorded_call_arguments():
    Pair = collections.namedtuple("Pair", "cos sin")
    args = ((torch.ones(2), None), {"position_embeddings": Pair(torch.ones(3), torch.zeros(3)), "mask": [torch.ones(1)],
                                    "flag": True})
    moved = to_device(args, torch.device("meta"))
    pe = moved[1]["position_embeddings"]
    assert isinstance(pe, Pair) and pe.cos.is_meta and pe.sin.is_meta
    assert moved[0][0].is_meta and moved[0][1] is None and moved[1]["mask"][0].is_meta and moved[1]["flag"] is True


def test_on_device_without_a_device_is_a_no_op(tiny_llama):
    block = tiny_llama.model.layers[0]
    with on_device(block, None):
        assert model_device(block).type == "cpu"
    with on_device(block, torch.device("cpu")):
        assert model_device(block).type == "cpu"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_place_on_cuda_and_back_and_one_block_at_a_time(dtype):
    from tiny_families import family

    model = family("llama", tie_word_embeddings=True)
    place(model, resolve_device("cuda"), dtype)
    assert model_device(model).type == "cuda" and floating_dtype(model) == dtype
    assert model.lm_head.weight is model.model.embed_tokens.weight
    place(model, torch.device("cpu"), torch.float32)
    assert model_device(model).type == "cpu" and floating_dtype(model) == torch.float32
    block = model.model.layers[0]
    with on_device(block, torch.device("cuda")):
        assert model_device(block).type == "cuda" and model_device(model.model.layers[1]).type == "cpu"
    assert model_device(block).type == "cpu"
