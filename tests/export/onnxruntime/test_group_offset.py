"""A kept source grid (``ptq_int8 source_grid``) through the fused ONNX Runtime graph: each
offset path becomes the sum of each group of input columns times its offsets, added to the
MatMulNBits output, and the graph gives the eager model's logits."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from export.onnxruntime.exporter import OnnxRuntimeExporter
from export.decoding.runtime import EagerRunner
from export.verify import logits_parity

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, initializer_range=0.2,
            tie_word_embeddings=True, rope_theta=100000.0)
IDS = torch.arange(1, 41) * 37 % 4000


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    g = w.float().unflatten(-1, (-1, 32))
    lo = g.amin(-1, keepdim=True).half().float()
    d = ((g.amax(-1, keepdim=True) - lo) / 15).half().float()
    return (lo + d * ((g - lo) / d).round().clamp(0, 15)).flatten(-2)


def _grid_model(offset: str, head_fp32: bool = False):
    from optimize.stage_api import StageContext
    from optimize.stages.ptq_int8 import Ptq8Config, ptq_int8
    from targets.sources import RandomSource, load_model

    lm = load_model(RandomSource(config=dict(TINY), seed=0))
    with torch.no_grad():
        for name, mod in lm.model.named_modules():
            if isinstance(mod, nn.Linear) and name != "lm_head":
                mod.weight.copy_(_q4_1(mod.weight))
    ctx = StageContext(tokenizer=lm.tokenizer, calibration=[], train_ids=None, target=None, work_dir=Path("."),
                       log=lambda *_: None)
    cfg = Ptq8Config(scheme="8da4w", source_grid=True, source_grid_offset=offset,
                     keep_high_precision=["lm_head"] if head_fp32 else [], int8_modules=[] if head_fp32 else ["lm_head"])
    with torch.no_grad():
        return ptq_int8(lm.model, cfg, ctx), lm.tokenizer


def _weights_dequantized(model):
    """The eager model with fp32 activations: every torchao weight de-quantized in place."""
    import copy

    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, nn.Linear) and type(m.weight) not in (torch.Tensor, nn.Parameter):
            m.weight = nn.Parameter(m.weight.dequantize(), requires_grad=False)
    return ref


def test_offset_paths_reach_the_fused_graph(tmp_path):
    """fp32 activations (accuracy_level 1): the ORT logits equal the eager model's with the same
    weights to 1e-4; every projection carries its offset path (q/k/v packed: one per layer)."""
    model, tok = _grid_model("fp32", head_fp32=True)
    res = OnnxRuntimeExporter().export(model, tok, tmp_path, {"accuracy_level": 1}, log=lambda *_: None)
    ops = res.manifest["ops"]
    assert ops["MatMulNBits"] == ops["MatMul"] - 1 == 2 * 5, ops  # qkv o gate up down; the head fp32
    par = logits_parity(EagerRunner(_weights_dequantized(model)), OnnxRuntimeExporter().load(res.artifact), [IDS])
    assert par["max_abs_diff"] < 1e-4, par


def test_int8_offset_and_activations_track_eager(tmp_path):
    """The default int8 offset path and ORT's int8 activations (accuracy_level 4, per block where
    eager quantizes per token): the logits stay within 0.1 of their spread of eager's (measured
    0.04) and the argmax agrees on at least 95% of the positions."""
    model, tok = _grid_model("int8")
    res = OnnxRuntimeExporter().export(model, tok, tmp_path, {}, log=lambda *_: None)
    runner = OnnxRuntimeExporter().load(res.artifact)
    runner.reset()
    got = runner.forward(IDS)
    with torch.no_grad():
        eager = model(IDS.view(1, -1)).logits[0]
    assert float((got - eager).abs().mean()) < 0.1 * float(eager.std())
    assert float((got.argmax(-1) == eager.argmax(-1)).float().mean()) >= 0.95
