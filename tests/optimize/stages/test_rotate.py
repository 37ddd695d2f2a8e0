"""The rotate stage: refused at validation where it cannot be exact (with the YAML path), exact in a
pipeline, an untied model survives the stage checkpoint, and the rotated model exports unchanged
through every target (an ordinary model of the same architecture)."""

from __future__ import annotations

import pytest
import torch

from optimize import load_config, run_pipeline
from optimize.errors import ConfigError
from tiny_families import family


def _problems(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    return str(err.value)


@pytest.mark.parametrize(
    "arch,stage,message",
    [
        ("gpt2", {}, "supported: "),
        ("gemma2", {}, "sandwich norms"),
        ("llama", {"r1": False, "r2": False}, "both false"),
        ("llama", {"tied": "refuse"}, "tied: refuse forbids"),
        ("llama", {"matrix": "walsh"}, "'hadamard' or 'random'"),
    ],
)
def test_validate_refuses(tiny_cfg, tiny_config, arch, stage, message):
    tiny_cfg["model"]["config"] = tiny_config(arch)
    tiny_cfg["stages"] = [{"kind": "rotate", **stage}]
    text = _problems(tiny_cfg)
    assert "stages.0" in text and message in text, text


def test_validate_accepts_r2_alone_on_sandwich_norms(tiny_cfg, tiny_config):
    tiny_cfg["model"]["config"] = tiny_config("gemma2")
    tiny_cfg["stages"] = [{"kind": "rotate", "r1": False}]
    assert load_config(tiny_cfg).stages[0].r2


def test_tied_quantize_embedding_after_an_untying_rotate_is_refused(tiny_cfg):
    """R1 unties a tied embedding (planned_config), so a later stage that needs the tie is refused up front."""
    tiny_cfg["target"] = "onnxruntime"
    tiny_cfg["stages"] = [{"kind": "rotate"},
                          {"kind": "ptq_int8", "scheme": "8da4w", "keep_high_precision": [], "quantize_embedding": "tied"}]
    text = _problems(tiny_cfg)
    assert "stages.1" in text and "tied" in text, text


def _hf_dir(tmp_path, tokenizer, arch="qwen2"):
    """A tiny model with perturbed norms saved as a Hugging Face directory (with SmolLM2's
    tokenizer): R1 must untie it."""
    model = family(arch, tie_word_embeddings=True, vocab_size=49152, max_position_embeddings=1024)
    path = tmp_path / f"{arch}-hf"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_untied_model_survives_the_stage_checkpoint(tmp_path):
    from optimize import checkpoints as ckpt
    from optimize.quant.rotate import plan_rotation, rotate_model

    model = family("mistral", tie_word_embeddings=True)
    rotate_model(model, plan_rotation(model), r1=True, r2=True, matrix="hadamard", seed=0)
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        ref = model(ids).logits
    ckpt.save_stage(tmp_path / "s", model, {"index": 0}, {"kind": "rotate"})
    again, _ = ckpt.load_stage(tmp_path / "s", [])
    assert again.get_output_embeddings().weight is not again.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


def test_rotate_in_a_pipeline_is_exact_and_reported(tiny_cfg, tmp_path, smollm2_tokenizer):
    tiny_cfg["model"] = {"source": "hf", "path": str(_hf_dir(tmp_path, smollm2_tokenizer))}
    tiny_cfg["stages"] = [{"kind": "rotate"}]
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok, report.rows[-1].error
    row = report.row("0:rotate")
    assert row.details["untied_embeddings"] and row.details["untied_bytes"] == 49152 * 64 * 4
    assert row.details["exactness"]["relative_diff"] < 1e-5
    assert abs(row.metrics.kl_divergence) < 1e-5 and row.metrics.top1_agreement == 1.0
    assert "randomized Hadamard" in row.details["r1"] and "randomized Hadamard" in row.details["r2"]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["executorch", "onnxruntime", "torchchat"])
def test_rotated_model_exports_unchanged(tiny_cfg, tmp_path, smollm2_tokenizer, target):
    """fp32 export of an untied, rotated model: the runtime's perplexity equals the eager one."""
    tiny_cfg["model"] = {"source": "hf", "path": str(_hf_dir(tmp_path, smollm2_tokenizer, "llama"))}
    tiny_cfg["stages"] = [{"kind": "rotate"}]
    tiny_cfg["target"] = target
    tiny_cfg["checks"]["generate_tokens"] = 4
    if target == "executorch":
        tiny_cfg["export"] = {"executorch": {"quantize": "none", "max_seq_len": 160}}
    if target == "torchchat":  # the Meta-layout checkpoint; its .pte and .pt2 are the other targets' code paths
        tiny_cfg["export"] = {"torchchat": {"pte": False, "pt2": False}}
    report = run_pipeline(load_config(tiny_cfg), say=lambda m: None)
    assert report.ok, [r.error for r in report.rows]
    eager, exported = report.row("0:rotate").metrics, report.rows[-1].metrics
    assert report.rows[-1].kind.startswith("export")
    assert abs(exported.perplexity - eager.perplexity) / eager.perplexity < 1e-3
