"""Pipeline stages in one process: the blocks split evenly, the stages chained reproduce the whole
model's logits for every family the pipeline takes (sliding windows and experts included), and
the kept parameters keep the whole model's names (so checkpoints move between layouts)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import TINY_CONFIGS
from train.parallel.layout import Layout
from train.parallel.pipeline import keep_stage, stage_blocks


def test_blocks_split_contiguously_with_the_remainder_first():
    assert stage_blocks(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_blocks(2, 2) == [range(0, 1), range(1, 2)]
    assert sum(len(r) for r in stage_blocks(7, 3)) == 7


def _model(arch: str) -> torch.nn.Module:
    kw = {**TINY_CONFIGS[arch], "vocab_size": 512, "pad_token_id": 0, "tie_word_embeddings": False,
          "num_hidden_layers": 3}
    if arch in ("mistral", "mixtral", "phi3"):
        kw["sliding_window"] = 6  # shorter than the 16-token input: the stages must build the window mask
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).eval()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "mixtral"])
def test_chained_stages_give_the_whole_models_logits(arch):
    model = _model(arch)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        names = set(model.state_dict())
        h, kept = ids, set()
        for rank in range(2):
            pmesh = SimpleNamespace(layout=Layout(pp=2), pp_rank=rank)
            stage = keep_stage(copy.deepcopy(model), pmesh)
            kept |= set(stage.state_dict())
            h = stage(h)
    scale = float(ref.abs().max())
    assert float((h - ref).abs().max()) <= 1e-5 * scale  # fp32, same ops in the same order
    assert kept == names  # every parameter on exactly the stage that owns it, under its own name
