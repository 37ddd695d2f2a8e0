"""The decoder blocks' GPTQ kept for another run: a run whose head differs reuses the blocks and
quantizes exactly as it would have alone (every integer and scale equal); anything that changes
the blocks' result is another key; a damaged entry is computed again; the cache is bounded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optimize.quant import gptq_cache
from optimize.quant.fakequant import WeightScheme
from optimize.quant.gptq_sequential import gptq_model


def _setup(model_type: str = "llama"):
    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    from train.model_parts import decoder_blocks

    model = family(model_type).eval()
    blocks = [n for n, _ in decoder_blocks(model)]
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    body = {n: WeightScheme(4, 32, True) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and any(n.startswith(b + ".") for b in blocks) and m.in_features % 32 == 0}
    windows = [torch.randint(1, 500, (48,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    return model, body, head, windows


def _run(model, targets, windows, cache_dir, dtype=torch.float64):
    return gptq_model(copy.deepcopy(model), targets, windows, blocks_cache=cache_dir, calibration_dtype=dtype)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen2"])
def test_another_head_reuses_the_blocks_and_quantizes_as_alone(model_type, tmp_path, monkeypatch):
    from optimize.quant import gptq_sequential

    model, body, head, windows = _setup(model_type)
    first = _run(model, body | {head: WeightScheme(8, None, True)}, windows, tmp_path)
    assert first.blocks_cache == "stored"
    int4_head = body | {head: WeightScheme(4, 32, True)}
    model.config._name_or_path = "another/run/stages/00-awq"  # reloaded from another run's checkpoint: same blocks
    solved: list[int] = []  # the Linears each GPTQ solve took
    real = gptq_sequential.gptq_layers
    monkeypatch.setattr(gptq_sequential, "gptq_layers", lambda ws, *a, **k: solved.append(len(ws)) or real(ws, *a, **k))
    reused = _run(model, int4_head, windows, tmp_path)
    assert solved == [1], solved  # the head alone was calibrated and solved
    alone = _run(model, int4_head, windows, None)
    assert reused.blocks_cache == "reused" and alone.blocks_cache is None
    assert sum(solved[1:]) == len(int4_head)
    assert reused.layers.keys() == alone.layers.keys()
    for name in alone.layers:
        assert torch.equal(reused.layers[name].q, alone.layers[name].q), name
        assert torch.equal(reused.layers[name].scale, alone.layers[name].scale), name
    assert reused.summary() == alone.summary() and reused.steps == alone.steps


@pytest.mark.parametrize("change", ["weights", "windows", "scheme", "option", "dtype"])
def test_anything_that_changes_the_blocks_is_another_key(change, tmp_path):
    model, body, head, windows = _setup()
    targets = body | {head: WeightScheme(8, None, True)}
    _run(model, targets, windows, tmp_path)
    kwargs = {}
    if change == "weights":
        model = copy.deepcopy(model)
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
    elif change == "windows":
        windows = windows[:2]
    elif change == "scheme":
        targets = {n: WeightScheme(8, None, True) for n in targets}
    elif change == "option":
        kwargs = {"act_order": False}
    second = gptq_model(copy.deepcopy(model), targets, windows, blocks_cache=tmp_path,
                        calibration_dtype=torch.float32 if change == "dtype" else torch.float64, **kwargs)
    assert second.blocks_cache == "stored", change


def test_a_damaged_entry_is_computed_again_and_the_cache_is_bounded(tmp_path, monkeypatch):
    model, body, head, windows = _setup()
    targets = body | {head: WeightScheme(8, None, True)}
    _run(model, targets, windows, tmp_path)
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    (entry / gptq_cache.ENTRY).write_bytes(b"garbage")
    assert _run(model, targets, windows, tmp_path).blocks_cache == "stored"
    monkeypatch.setattr(gptq_cache, "KEEP", 2)
    for k in range(3):
        _run(model, targets, windows[: k + 1], tmp_path)
    assert len([p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 2


def test_without_a_head_nothing_is_kept(tmp_path):
    """The entry carries the states after the last block, which only a run with a head computes."""
    model, body, _, windows = _setup()
    assert _run(model, body, windows, tmp_path).blocks_cache is None
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
