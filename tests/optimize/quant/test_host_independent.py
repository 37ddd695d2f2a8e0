"""optimize/quant/host_independent.py: the calibration's casts and its float32 matrix products."""

from __future__ import annotations

import torch
from torch import nn

from optimize.quant.host_independent import computing_in, linears_in


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32, bias=False))


def test_linears_in_float32_multiplies_float64_activations_in_float32_and_restores_forward():
    model = _model()
    x = torch.randn(5, 64, dtype=torch.float64)
    seen = []
    model[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    with computing_in(model, torch.float64):
        full = model(x)
        with linears_in(model, torch.float32) as switched:
            mixed = model(x)
        again = model(x)
    assert switched == 2
    # what the context promises, step by step: products of float32-rounded operands, handed back in float64
    h = nn.functional.linear(x.float(), model[0].weight.float(), model[0].bias.float()).double()
    h = nn.functional.gelu(h)
    want = nn.functional.linear(h.float(), model[2].weight.float()).double()
    assert mixed.dtype == torch.float64
    assert torch.equal(mixed, want)
    assert not torch.equal(mixed, full)  # the float64 products differ in their last bits: the test can see it
    assert torch.equal(again, full)  # restored: the class's forward again
    assert all("forward" not in m.__dict__ for m in model)
    assert seen == [torch.float64] * 3  # the hooks (GPTQ's Hessians) still see the float64 activations
    assert (mixed - full).abs().max() <= 1e-5 * full.abs().max()


def test_linears_in_none_changes_nothing_and_an_own_forward_comes_back():
    model = _model()
    own = model[2].forward
    model[2].forward = own  # a wrapper's instance forward, as BlockChain installs
    with linears_in(model, None) as switched:
        assert switched == 0 and model[0].__dict__.get("forward") is None
    with linears_in(model, torch.float32):
        assert model[2].forward is not own
    assert model[2].__dict__["forward"] is own and "forward" not in model[0].__dict__
