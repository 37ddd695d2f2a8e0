"""GPTQ's column loop as CUDA graphs: the eager loop's integers, proven on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optimize.quant.fakequant import scheme_for


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma"])
def test_cuda_graphs_of_the_column_loop_give_the_eager_integers(model_type, monkeypatch):
    """On CUDA the column loop replays as CUDA graphs: every layer's integers and scales equal the
    eager loop's, the graphs were captured and replayed (not silently switched off)."""
    import copy

    from tiny_families import family  # tests/optimize is on sys.path (its conftest)

    import optimize.quant.gptq_rows as gptq_rows
    import optimize.quant.gptq_sequential as gptq_mod

    model = family(model_type).cuda().eval()
    targets = {n: scheme_for("8da4w", 32) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n != "lm_head"}
    g = torch.Generator().manual_seed(5)
    windows = [torch.randint(1, 500, (64,), generator=g) for _ in range(2)]
    graphed = gptq_mod.gptq_model(copy.deepcopy(model), targets, windows)
    assert graphed.cuda_graphs and graphed.cuda_graphs["disabled"] is None, graphed.cuda_graphs
    assert graphed.cuda_graphs["captured"] > 0 and graphed.cuda_graphs["replayed"] > 0
    monkeypatch.setattr(gptq_rows.RowGraphs, "MAX_ELEMENTS", 0)
    eager = gptq_mod.gptq_model(copy.deepcopy(model), targets, windows)
    assert eager.cuda_graphs is None
    for name in targets:
        assert torch.equal(graphed.layers[name].q, eager.layers[name].q), name
        assert torch.equal(graphed.layers[name].scale, eager.layers[name].scale), name
