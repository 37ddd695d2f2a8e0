"""Regression watch: int8 weight-only lowered to XNNPACK returns wrong logits (executorch 1.4.1, 1.5.1).

The ExecuTorch target refuses the scheme because of this (targets/profiles/executorch.yaml,
``refused_schemes.int8wo``). These tests assert the output is still WRONG. The day they fail,
ExecuTorch has fixed the bug: check the .pte against eager, then offer int8wo on the target
again and turn these assertions around.
"""

from __future__ import annotations

import copy

import pytest
import torch


def _configs():
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerAxis

    return {
        "IntxWeightOnlyConfig(int8)": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
        "Int8WeightOnlyConfig": Int8WeightOnlyConfig(),
    }


@pytest.mark.parametrize("config", ["IntxWeightOnlyConfig(int8)", "Int8WeightOnlyConfig"])
def test_int8_weight_only_on_xnnpack_is_still_wrong(tmp_path, config):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).eval()
    x = torch.randn(4, 64)
    quantized = copy.deepcopy(linear)
    quantize_(quantized, _configs()[config])
    with torch.no_grad():
        eager = quantized(x)
        # the eager int8 weight-only model itself is right: close to fp32
        assert (eager - linear(x)).abs().max() < 0.02
    ep = torch.export.export(quantized, (x,), strict=False)
    program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
    path = tmp_path / "linear.pte"
    path.write_bytes(program.buffer)
    out = Runtime.get().load_program(path).load_method("forward").execute([x])[0]
    err = float((out - eager).abs().max())
    # Measured on executorch 1.5.1: max error ~1.5e3 on outputs of magnitude ~1.5.
    assert err > 1.0, (
        f"{config} lowered to XNNPACK now matches eager (max error {err:.3g}): ExecuTorch seems to have "
        "fixed int8 weight-only. Verify on a real model, then allow int8wo in the executorch target."
    )
