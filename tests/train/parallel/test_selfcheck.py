"""Every parallel wrapper on a one-device mesh (a gloo group of one in this process) against the
plain model, for several families: the code bench/gpu.py runs on CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import TINY_CONFIGS
from train.parallel.selfcheck import degenerate_layouts

#: fp32, the same math reordered (DTensor reductions, the mesh-wide norm): rounding only
TOL = 1e-5


@pytest.mark.parametrize("arch, ran", [
    ("llama", {"tp", "pp"}),
    ("qwen3", {"tp", "pp"}),
    ("gemma2", {"tp"}),
    ("phi3", {"pp"}),
    ("mixtral", {"pp", "ep"}),
])
def test_each_wrapper_alone_matches_the_plain_model(arch, ran):
    kw = {**TINY_CONFIGS[arch], "vocab_size": 512, "pad_token_id": 0, "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw))
    results = degenerate_layouts(model, torch.device("cpu"))
    assert {dim for dim, r in results.items() if "skipped" not in r} == ran, results
    for dim in ran:
        r = results[dim]
        assert r["loss_rel"] <= TOL and r["grad_rel"] <= TOL and r["grad_norm_rel"] <= TOL, (dim, r)
