"""optimize/quant/calibration_hooks.py: the Hessian's Gram product."""

from __future__ import annotations

import pytest
import torch

from optimize.quant.calibration_hooks import gram


@pytest.mark.parametrize("d", [48, 576, 1000, 1536, 2049])  # one block, three, four with a short last one
def test_gram_is_the_symmetric_product_of_the_columns(d):
    x = torch.randn(300, d, generator=torch.Generator().manual_seed(d))
    g = gram(x)
    ref = x.double().t() @ x.double()
    # float32 products over 300 rows: within a few float32 ulps of the float64 reference
    assert (g.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    if d >= 384:  # the mirrored halves are the same numbers
        assert torch.equal(g, g.t())
