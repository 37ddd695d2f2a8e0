"""``ptq_int8 source_grid``: a weight already on a 4-bit grid (a GGUF Q4_0/Q4_1 source) is installed
exactly as XNNPACK's symmetric int4 plus a per-group offset path, on every decoder family; a float
weight is not taken for a grid; the offset paths survive a stage checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optimize import load_config
from optimize.quant.fakequant import qdq_act_per_token, qdq_weight, scheme_for
from optimize.quant.source_grid import GroupOffsetLinear, find_grid
from optimize.stage_api import StageContext, get_stage
from tiny_families import FAMILIES, family


def q4_1(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``w`` rounded as GGUF's Q4_1 stores it: per group of ``group`` columns, fp16 ``d`` and ``m``,
    16 levels ``m + d·k``."""
    g = w.float().unflatten(-1, (-1, group))
    lo = g.amin(-1, keepdim=True).half().float()
    d = ((g.amax(-1, keepdim=True) - lo) / 15).half().float()
    return (lo + d * ((g - lo) / d).round().clamp(0, 15)).flatten(-2)


def q4_0(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """GGUF's Q4_0: symmetric, ``d·(k - 8)``."""
    g = w.float().unflatten(-1, (-1, group))
    d = (g.abs().amax(-1, keepdim=True) / 8).half().float()
    return (d * (g / d).round().clamp(-8, 7)).flatten(-2)


def test_a_q4_1_weight_is_found_and_split_exactly():
    w = q4_1(torch.randn(48, 128))
    split = find_grid(w)
    assert split is not None and split.offset is not None
    assert split.q.dtype == torch.int8 and int(split.q.min()) >= -8 and int(split.q.max()) <= 7
    assert torch.equal(split.dequantized(), w)


def test_a_q4_0_weight_needs_no_offset_path():
    split = find_grid(q4_0(torch.randn(48, 128)))
    assert split is not None and split.offset is None


def test_groups_that_use_few_levels_are_on_the_grid_too():
    """A group using levels 2..9 of its grid only: the step is still found, values exact."""
    w = q4_1(torch.randn(8, 64))
    w[:, :32] = 0.25 + 0.125 * torch.randint(2, 10, (8, 32)).float()
    w[3, 32:] = 1.5  # a constant group
    split = find_grid(w)
    assert split is not None and torch.allclose(split.dequantized(), w, atol=1e-6)


def test_a_float_weight_is_no_grid():
    assert find_grid(torch.randn(16, 64)) is None
    w = q4_1(torch.randn(16, 64))
    w[5, 40] += 1e-3  # one value off its grid: the weight is not on one
    assert find_grid(w) is None


def test_group_offset_linear_computes_the_grid_weight():
    """Unquantized (plain integers x scales in the Linear): the group-sum rows and the offsets
    give ``x W^T + b`` back."""
    from optimize.quant.source_grid import offset_module

    w = q4_1(torch.randn(24, 96))
    split = find_grid(w)
    lin = nn.Linear(96, 24, bias=True)

    def install(m, q, s):
        with torch.no_grad():
            m.weight.copy_((q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2))

    mod = offset_module(lin, split, install)
    x = torch.randn(2, 5, 96)
    assert torch.allclose(mod(x), F.linear(x, w, lin.bias), atol=1e-5)


def _ctx(tmp_path: Path) -> StageContext:
    g = torch.Generator().manual_seed(3)
    wins = [torch.randint(0, 500, (64,), generator=g) for _ in range(2)]
    return StageContext(tokenizer=None, calibration=wins, train_ids=torch.zeros(0, dtype=torch.long),
                        target=None, work_dir=tmp_path, log=lambda s: None)


def _gridded(arch: str, rounding=q4_1) -> nn.Module:
    """A tiny model of ``arch`` whose decoder Linears are rounded onto a GGUF grid (the head not)."""
    model = family(arch)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and name != "lm_head" and mod.in_features % 32 == 0:
                mod.weight.copy_(rounding(mod.weight))
    return model


def _stage(tiny_cfg, **opts):
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "source_grid": True, **opts}]
    return load_config(tiny_cfg).stages[0]


class _SplitRef(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        split = find_grid(lin.weight)
        self.w = (split.q.float().unflatten(-1, (-1, 32)) * split.scale.unsqueeze(-1)).flatten(-2)
        self.r = split.offset if split.offset is not None else torch.zeros_like(split.scale)
        self.bias = lin.bias

    def forward(self, x):
        xq = qdq_act_per_token(x)  # the group sums come out of the int4 GEMM: from the int8 activations
        return F.linear(xq, self.w, self.bias) + F.linear(xq.unflatten(-1, (-1, 32)).sum(-1), self.r)


@pytest.mark.parametrize("arch", FAMILIES)
def test_stage_keeps_the_grid_exactly_on_every_family(arch, tiny_cfg, tmp_path):
    """With an fp32 offset path each replaced Linear computes the split written out (int8
    activations into the symmetric int4 part, their group sums into the offset) to 1e-5 of its
    output scale, and the model is several times closer to the unrounded one than rounding the
    grid again (round-to-nearest int4)."""
    import copy

    from torchao.quantization import IntxUnpackedToInt8Tensor

    base = _gridded(arch)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fp32 = base(ids).logits
        cfg = _stage(tiny_cfg, keep_high_precision=["lm_head"], source_grid_offset="fp32")
        ctx = _ctx(tmp_path)
        model = get_stage("ptq_int8").fn(copy.deepcopy(base), cfg, ctx)
        got = model(ids).logits
        rtn = get_stage("ptq_int8").fn(copy.deepcopy(base), _stage(tiny_cfg, keep_high_precision=["lm_head"],
                                                                    source_grid=False), _ctx(tmp_path))(ids).logits
        for name, mod in model.named_modules():
            if isinstance(mod, GroupOffsetLinear):
                x = torch.randn(3, mod.in_features)
                want = _SplitRef(base.get_submodule(name))(x)
                assert float((mod(x) - want).abs().max() / want.abs().max()) < 1e-5, name
    scale = fp32.abs().max()
    err, err_rtn = float((got - fp32).abs().max() / scale), float((rtn - fp32).abs().max() / scale)
    assert err * 4 < err_rtn, (err, err_rtn)
    d = ctx.details["source_grid"]
    assert d["layers"] == ctx.details["linear_quantized"] and d["max_relative_error"] < 1e-6
    offsets = [m for m in model.modules() if isinstance(m, GroupOffsetLinear)]
    assert len(offsets) == d["with_offset_path"] == d["layers"]
    assert all(isinstance(m.linear.weight, IntxUnpackedToInt8Tensor) for m in offsets)


def test_q4_0_source_gets_plain_int4_layers(tiny_cfg, tmp_path):
    base = _gridded("qwen2", rounding=q4_0)
    ctx = _ctx(tmp_path)
    model = get_stage("ptq_int8").fn(base, _stage(tiny_cfg, keep_high_precision=["lm_head"]), ctx)
    assert ctx.details["source_grid"]["with_offset_path"] == 0
    assert not [m for m in model.modules() if isinstance(m, GroupOffsetLinear)]
    assert not hasattr(model.config, "edge_optimize_source_grid")


def test_off_grid_layers_go_through_the_stage_algorithm(tiny_cfg, tmp_path):
    """The lm_head (not on a grid) is quantized by GPTQ as the config says; the grid layers are not."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    ctx = _ctx(tmp_path)
    model = get_stage("ptq_int8").fn(_gridded("llama"), _stage(tiny_cfg, keep_high_precision=[], algorithm="gptq",
                                                                int8_modules=["lm_head"]), ctx)
    assert ctx.details["gptq"]["layers"] == 1
    assert isinstance(model.lm_head.weight, IntxUnpackedToInt8Tensor) and model.lm_head.weight.target_dtype == torch.int8
    assert ctx.details["source_grid"]["layers"] == ctx.details["linear_quantized"] - 1


def test_int8_offset_path_is_close(tiny_cfg, tmp_path):
    """The int8 offset path costs little against the default fp32 one (1% of the logit scale)."""
    import copy

    from torchao.quantization import IntxUnpackedToInt8Tensor

    base = _gridded("mistral")
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact_model = get_stage("ptq_int8").fn(copy.deepcopy(base), _stage(tiny_cfg), _ctx(tmp_path))
        int8_model = get_stage("ptq_int8").fn(copy.deepcopy(base), _stage(tiny_cfg, source_grid_offset="int8"),
                                              _ctx(tmp_path))
        exact, int8 = exact_model(ids).logits, int8_model(ids).logits
    path = "model.layers.0.mlp.down_proj.offset"
    assert type(exact_model.get_submodule(path).weight) is nn.Parameter
    assert isinstance(int8_model.get_submodule(path).weight, IntxUnpackedToInt8Tensor)
    assert float((int8 - exact).abs().max() / exact.abs().max()) < 1e-2


def test_a_float_model_is_refused(tiny_cfg, tmp_path):
    with pytest.raises(ValueError, match="not converted from a GGUF"):
        get_stage("ptq_int8").fn(family("llama"), _stage(tiny_cfg), _ctx(tmp_path))


def test_offset_paths_survive_the_stage_checkpoint(tiny_cfg, tmp_path):
    from optimize import checkpoints as ckpt
    from optimize.stage_api import restorers

    cfg = _stage(tiny_cfg, keep_high_precision=[])
    model = get_stage("ptq_int8").fn(_gridded("phi3"), cfg, _ctx(tmp_path))
    ids = torch.randint(0, 500, (1, 16))
    with torch.no_grad():
        ref = model(ids).logits
    ckpt.save_stage(tmp_path / "s", model, {"index": 0}, cfg.model_dump())
    again, _ = ckpt.load_stage(tmp_path / "s", restorers([cfg]))
    assert sum(isinstance(m, GroupOffsetLinear) for m in again.modules()) == sum(
        isinstance(m, GroupOffsetLinear) for m in model.modules()) > 0
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


@pytest.mark.parametrize("opts,message", [
    ({"scheme": "8da8w"}, "only to scheme 8da4w"),
    ({"source_grid": False, "source_grid_offset": "fp32"}, "only with source_grid"),
    ({"source_grid_offset": "fp16"}, "'fp32' or 'int8'"),
    ({"source_grid": "sometimes"}, "valid boolean"),
])
def test_config_refuses(tiny_cfg, opts, message):
    from optimize.errors import ConfigError

    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "source_grid": True, **opts}]
    with pytest.raises(ConfigError, match=message) as err:
        load_config(tiny_cfg)
    assert "stages.0" in str(err.value)


def test_torchchat_is_refused_at_validate(tiny_cfg):
    from optimize.errors import ConfigError

    tiny_cfg["target"] = "torchchat"
    tiny_cfg["stages"] = [{"kind": "ptq_int8", "scheme": "8da4w", "source_grid": True}]
    with pytest.raises(ConfigError, match="re-quantizes the weights itself") as err:
        load_config(tiny_cfg)
    assert "stages.0" in str(err.value)


def test_rtn_reference_is_what_the_stage_would_round_otherwise():
    """Sanity of the premise: rounding a Q4_1 weight to symmetric int4 again changes it."""
    w = q4_1(torch.randn(32, 64))
    assert not torch.equal(qdq_weight(w, scheme_for("8da4w", 32)), w)


def test_the_output_projection_is_never_replaced(tiny_cfg, tmp_path):
    """A head on a grid too stays a Linear (exporters read its weight; it may share the
    embedding's table): it is quantized by the stage's algorithm."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    model = _gridded("qwen3")
    with torch.no_grad():
        model.lm_head.weight = nn.Parameter(q4_1(model.lm_head.weight.detach().clone()))
    ctx = _ctx(tmp_path)
    model = get_stage("ptq_int8").fn(model, _stage(tiny_cfg, keep_high_precision=[]), ctx)
    assert type(model.lm_head) is nn.Linear and isinstance(model.lm_head.weight, IntxUnpackedToInt8Tensor)
    assert ctx.details["source_grid"]["layers"] == ctx.details["linear_quantized"] - 1
