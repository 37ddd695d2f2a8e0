"""Stage checkpoints across architecture families: a resumed model is the same model.

Non-persistent buffers (Gemma's ``embed_scale``, rotary ``inv_freq``, BERT's ``position_ids``)
are not in the state dict; resuming used to crash on them. Also: checkpoints are fsynced,
and a checkpoint that does not fit, or carries a pickle payload, is refused by name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from optimize import checkpoints as ckpt
from optimize import load_config, run_pipeline

FAMILIES = ["gemma", "gemma2", "gemma3_text", "qwen2", "phi3", "gpt2", "llama", "opt", "gpt_neox"]


def _build(config: dict, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=dtype)
    return model.eval()


def _ids(n=12):
    return torch.randint(0, 49152, (1, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch", FAMILIES + ["bert_decoder"])
def test_load_stage_rebuilds_non_persistent_buffers(arch, tiny_config, tmp_path):
    config = tiny_config("bert", is_decoder=True) if arch == "bert_decoder" else tiny_config(arch)
    model = _build(config)
    path = ckpt.save_stage(tmp_path / "stage", model, {"status": "pass"}, {"kind": "x"})
    resumed, row = ckpt.load_stage(path, [])
    assert row == {"status": "pass"}
    before, after = dict(model.named_buffers()), dict(resumed.named_buffers())
    assert before.keys() == after.keys()
    for name, buf in before.items():
        assert after[name].dtype == buf.dtype and torch.equal(after[name], buf), name
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, resumed(_ids()).logits)


@pytest.mark.parametrize("arch", ["gemma", "llama"])
def test_bf16_checkpoint_keeps_buffer_dtypes(arch, tiny_config, tmp_path):
    """Gemma's embed_scale follows the model dtype; rotary inv_freq stays fp32."""
    model = _build(tiny_config(arch), dtype=torch.bfloat16)
    resumed, _ = ckpt.load_stage(ckpt.save_stage(tmp_path / "s", model, {}, {}), [])
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in resumed.named_buffers()}
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, resumed(_ids()).logits)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3_text", "qwen2", "phi3", "gpt2"])
def test_rerun_resumes_and_continues_on_the_same_model(arch, tiny_cfg, tiny_config):
    """Re-running the YAML resumes stage 0 from its checkpoint; a stage appended afterwards runs
    on the resumed model, and a no-op stage there measures exactly what stage 0 measured."""
    tiny_cfg["model"]["config"] = tiny_config(arch)
    tiny_cfg["data"] = {"eval_tokens": 64, "calibration_tokens": 32, "seq_len": 32}
    tiny_cfg["checks"] = {"latency": {"enabled": False}, "generate_tokens": 0}
    tiny_cfg["stages"] = [{"kind": "test_noise", "scale": 0.01}]
    first = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert first.ok, first.rows[-1].error
    tiny_cfg["stages"].append({"kind": "test_noise", "scale": 0.0})
    messages: list[str] = []
    again = run_pipeline(load_config(tiny_cfg), say=messages.append)
    assert again.ok, again.rows[-1].error
    assert [r.status for r in again.rows[1:]] == ["resumed", "pass"]
    assert any("starting at stage 1" in m for m in messages)
    assert again.rows[2].metrics.perplexity == pytest.approx(first.rows[1].metrics.perplexity, rel=1e-6)


def test_checkpoint_files_are_fsynced(tiny_config, tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        try:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ckpt.save_stage(tmp_path / "s", _build(tiny_config("llama")), {}, {})
    names = {Path(p).name for p in synced}
    assert {"model.pt", "COMPLETE", "config.json", "row.json"} <= names, names


class _Payload:
    """Unpickling this would create the marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_with_pickle_payload_is_refused_without_running_it(tiny_config, tmp_path):
    model = _build(tiny_config("llama"))
    path = ckpt.save_stage(tmp_path / "s", model, {}, {})
    marker = tmp_path / "payload-ran"
    state = dict(model.state_dict())
    state["model.norm.weight"] = _Payload(marker)
    torch.save(state, path / "model.pt")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_stage(path, [])
    msg = str(err.value)
    assert "model.pt" in msg and "references code" in msg and "resume: false" in msg
    assert not marker.exists()


def test_checkpoint_that_does_not_fit_names_the_keys(tiny_config, tmp_path):
    path = ckpt.save_stage(tmp_path / "s", _build(tiny_config("llama")), {}, {})
    state = torch.load(path / "model.pt", weights_only=True)
    state.pop("model.norm.weight")
    state["model.extra"] = torch.zeros(1)
    torch.save(state, path / "model.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"missing \['model.norm.weight'\], unexpected \['model.extra'\]"):
        ckpt.load_stage(path, [])
