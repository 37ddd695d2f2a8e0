"""ptq_config: the ptq_int8 stage's config sits below its stage, its GPTQ glue and QAT (no import
circle), and its layer plan is the one the stage quantizes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from optimize.stages.ptq_config import DEFAULT_EMBEDDING_GROUP_SIZE, DEFAULT_GROUP_SIZE, Ptq8Config

STAGES = Path(__file__).resolve().parents[3] / "optimize" / "stages"


def _imports(module: str) -> set[str]:
    """Every module ``optimize/stages/<module>.py`` imports, at any depth (TYPE_CHECKING and function bodies too)."""
    tree = ast.parse((STAGES / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("module,forbidden", [
    ("ptq_plan", {"optimize.stages.ptq_config", "optimize.stages.ptq_gptq", "optimize.stages.ptq_int8"}),
    ("ptq_config", {"optimize.stages.ptq_gptq", "optimize.stages.ptq_int8", "optimize.stages.qat"}),
    ("ptq_gptq", {"optimize.stages.ptq_int8", "optimize.stages.qat"}),
])
def test_the_ptq_modules_form_a_line_not_a_circle(module, forbidden):
    assert not _imports(module) & forbidden, f"{module} imports {sorted(_imports(module) & forbidden)}"


def test_the_stage_names_the_config_it_registers():
    from optimize.stage_api import get_stage
    from optimize.stages import ptq_int8

    assert ptq_int8.Ptq8Config is Ptq8Config and get_stage("ptq_int8").config_cls is Ptq8Config


def test_defaults_resolve_per_scheme():
    assert Ptq8Config().effective_group_size is None  # 8da8w: per output channel
    assert Ptq8Config(scheme="8da4w").effective_group_size == DEFAULT_GROUP_SIZE
    assert Ptq8Config(scheme="8da4w", group_size=64).effective_group_size == 64
    assert Ptq8Config(quantize_embedding="int4").effective_embedding_group_size == DEFAULT_EMBEDDING_GROUP_SIZE


def test_layer_plan_is_what_the_stage_quantizes(tiny_llama):
    import copy

    import torch
    from torchao.utils import TorchAOBaseTensor

    from optimize.stage_api import StageContext, get_stage

    cfg = Ptq8Config(scheme="8da4w", int8_modules=["*.down_proj"])
    p = cfg.layer_plan(tiny_llama)
    assert p["kept"] == ["lm_head"] and p["embedding"] is None
    assert p["int8"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    ctx = StageContext(tokenizer=None, calibration=[], train_ids=torch.zeros(0, dtype=torch.long), target=None,
                       work_dir=Path("."), log=lambda s: None)
    out = get_stage("ptq_int8").fn(copy.deepcopy(tiny_llama), cfg, ctx)
    quantized = sorted(n for n, m in out.named_modules() if isinstance(getattr(m, "weight", None), TorchAOBaseTensor))
    assert quantized == sorted(p["selected"])


def test_layer_plan_refuses_a_group_that_does_not_divide(tiny_llama):
    with pytest.raises(ValueError, match="ptq_int8: .*group"):
        Ptq8Config(scheme="8da4w", group_size=96).layer_plan(tiny_llama)
