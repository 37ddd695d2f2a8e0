"""A kept source grid (``ptq_int8 source_grid``) through ExecuTorch: the offset paths of fused
q/k/v and gate/up members are fused too (exact in eager, one linear of each kind per group in the
graph), and the ``.pte`` gives the eager logits with the pooling inside the XNNPACK delegate."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from export.executorch.fusion import fuse_projections, merge_duplicate_linears
from export.group_offset import GroupOffsetLinear

pytestmark = pytest.mark.timeout(900)

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1's rounding: 16 levels ``m + d·k`` per group of 32 columns, fp16 ``d`` and ``m``."""
    g = w.float().unflatten(-1, (-1, 32))
    lo = g.amin(-1, keepdim=True).half().float()
    d = ((g.amax(-1, keepdim=True) - lo) / 15).half().float()
    return (lo + d * ((g - lo) / d).round().clamp(0, 15)).flatten(-2)


def _grid_model(model_type: str = "qwen2", offset: str = "int8"):
    """A tiny model on a Q4_1 grid, through ``ptq_int8`` with ``source_grid`` (lm_head int8 by RTN)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimize.stage_api import StageContext, get_stage
    from optimize.stages.ptq_config import Ptq8Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **BASE)).eval()
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and name != "lm_head":
                mod.weight.copy_(_q4_1(mod.weight))
    cfg = Ptq8Config(scheme="8da4w", source_grid=True, source_grid_offset=offset, keep_high_precision=[],
                     int8_modules=["lm_head"])
    ctx = StageContext(tokenizer=None, calibration=[], train_ids=torch.zeros(0, dtype=torch.long), target=None,
                       work_dir=None, log=lambda s: None)
    with torch.no_grad():
        return get_stage("ptq_int8").fn(model, cfg, ctx)


def _plain_int4():
    """The same model as :func:`_grid_model` with its grids rounded again (no offset paths)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from torchao.quantization import quantize_

    from optimize.stages.ptq_config import Ptq8Config
    from optimize.stages.ptq_int8 import linear_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **BASE)).eval()
    quantize_(model, linear_config(Ptq8Config(scheme="8da4w")), filter_fn=lambda m, f: isinstance(m, nn.Linear)
              and f != "lm_head")
    quantize_(model, linear_config(Ptq8Config(scheme="8da8w")), filter_fn=lambda m, f: f == "lm_head")
    return model


def test_fused_offset_members_give_the_same_logits():
    model = _grid_model()
    fused = copy.deepcopy(model)
    counts = fuse_projections(fused)
    assert counts["fused"] == {"q_proj+k_proj+v_proj": 2, "gate_proj+up_proj": 2} and counts["left_apart"] == 0
    shared = fused.model.layers[0].self_attn.q_proj.fused_projection
    assert isinstance(shared, GroupOffsetLinear) and shared.out_features == 64 + 2 * 32
    assert shared.linear.weight.shape[0] == 64 + 2 * 32 + 2  # one copy of the two group-sum rows
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, model(ids).logits)


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_exported_graph_merges_the_shared_offset_paths():
    """Each member traces the shared int4 Linear and the shared offset Linear; merging leaves one
    of each per group, and every member keeps its own name for the scheme check."""
    from export.executorch.llm import ExecuTorchDecoder, plan_layers
    from export.executorch.quant import exported_linear_schemes

    model = _grid_model()
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    seq = torch.export.Dim("seq_len", min=1, max=32)

    def export(m):
        dec = ExecuTorchDecoder(m, plan_layers(m.config, 32))
        with torch.no_grad():
            return torch.export.export(dec, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                                       dynamic_shapes=({1: seq}, {0: seq}), strict=True)

    ep_plain, ep_fused = export(model), export(fused)
    assert exported_linear_schemes(ep_fused) == exported_linear_schemes(ep_plain)
    assert merge_duplicate_linears(ep_fused) == 2 * 3 * 2  # per layer: 3 int4 and 3 offset linears gone


class _Tok:
    eos_token_id, bos_token_id, pad_token_id = 2, 1, 0


@pytest.fixture(scope="module")
def plain_delegation():
    """How plain int4 (no offset) lowers: the delegation both offsets are compared with, lowered once."""
    from export.executorch.exporter import ExecuTorchOptions, lower_to_pte

    return lower_to_pte(_plain_int4(), _Tok(), ExecuTorchOptions(max_seq_len=32, quantize="none"),
                        log=lambda *_: None)[1]["delegation"]


@pytest.mark.slow
# both offsets on one worker, one after the other (a chain of `minutes`, tests/conftest.py): plain_delegation made once
@pytest.mark.minutes(1.1, chain="group-offset-pte")
@pytest.mark.parametrize("offset", ["int8", "fp32"])
def test_pte_gives_the_eager_logits(offset, plain_delegation, tmp_path):
    from export.executorch.exporter import ExecuTorchOptions, lower_to_pte
    from export.executorch.runner import ExecuTorchRunner
    from export.decoding.runtime import EagerRunner
    from export.verify import logits_parity

    model = _grid_model("llama", offset)
    data, details = lower_to_pte(model, _Tok(), ExecuTorchOptions(max_seq_len=32, quantize="none"), log=lambda *_: None)
    (tmp_path / "m.pte").write_bytes(data)
    ids = torch.randint(3, 256, (32,), generator=torch.Generator().manual_seed(2))
    parity = logits_parity(EagerRunner(model), ExecuTorchRunner(tmp_path / "m.pte"), [ids[:1], ids[:9], ids])
    assert parity["top1_agreement"] == 1.0 and parity["max_abs_diff"] < 5e-2, parity
    portable = details["delegation"]["portable_ops"]
    plain = plain_delegation
    # the offset paths stay inside the delegate, their adds included (o_proj's and down_proj's have
    # the residual's shape, and are told apart from it): as many delegate calls as plain int4 and
    # the same portable kernels
    assert details["delegation"]["delegate_calls"] == plain["delegate_calls"], (details["delegation"], plain)
    extra = {k: v - plain["portable_ops"].get(k, 0) for k, v in portable.items() if v != plain["portable_ops"].get(k, 0)}
    assert extra == {}, extra
    mix = details["quantization"]
    assert f"offset {'8da8w' if offset == 'int8' else 'fp32'}" in str(mix), mix
