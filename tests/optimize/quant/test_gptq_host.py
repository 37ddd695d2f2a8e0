"""AWQ and GPTQ give the same weights on every CPU vector path when they calibrate in float64.

Each case runs in a child process under one ``ATEN_CPU_CAPABILITY`` (the float paths that differ
between hosts: ``default`` is ATen's scalar code, ``avx2`` its vectorized one), on the same saved
weights and windows. In fp32 the two paths' activations differ in their last bits and GPTQ's
rounding follows them (tens of thousands of this tiny model's int4 weights differ, which also
shows the test can see a difference); in float64 not one may differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]

CHILD = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from optimize.quant.gptq_sequential import gptq_model
from optimize.quant.fakequant import scheme_for
state, windows, dtype, out = sys.argv[1:5]
m = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                                 num_key_value_heads=2, vocab_size=512)).eval()
m.load_state_dict(torch.load(state, weights_only=True))
from optimize.quant.awq import awq_scale
from optimize.quant.host_independent import computing_in
wins = torch.load(windows, weights_only=True)
calib = torch.float64 if dtype == "float64" else None
with computing_in(m, calib):
    awq_scale(m, wins, scheme_for("8da4w", 32), rows=64)
scaled = {f"awq:{k}": v.clone() for k, v in m.state_dict().items()}
names = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and "layers." in n]
res = gptq_model(m, {n: scheme_for("8da4w", 32) for n in names}, wins, scale_init="mse", calibration_dtype=calib)
torch.save({**scaled, **{n: r.q for n, r in res.layers.items()}}, out)
"""


def _run(tmp_path: Path, capability: str, dtype: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{capability}-{dtype}.pt"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "state.pt"), str(tmp_path / "windows.pt"),
                           dtype, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(out, weights_only=True)


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], awq: bool) -> int:
    assert a.keys() == b.keys()
    return sum(int((a[k] != b[k]).sum()) for k in a if k.startswith("awq:") == awq)


@pytest.mark.slow
def test_float64_calibration_is_host_independent(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the weights are made once, here: ATen's random kernels differ by path too
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=2, vocab_size=512))
    torch.save(model.state_dict(), tmp_path / "state.pt")
    g = torch.Generator().manual_seed(1)
    torch.save([torch.randint(0, 512, (256,), generator=g) for _ in range(2)], tmp_path / "windows.pt")

    fp32 = (_run(tmp_path, "default", "float32"), _run(tmp_path, "avx2", "float32"))
    f64 = (_run(tmp_path, "default", "float64"), _run(tmp_path, "avx2", "float64"))
    assert _differing(*fp32, awq=False) > 0, \
        "fp32 calibration gave identical integers on both paths: the test cannot see a difference"
    assert _differing(*f64, awq=True) == 0, "AWQ's scaled weights differ between ATen's default and avx2 paths in float64"
    assert _differing(*f64, awq=False) == 0, "GPTQ's int4 weights differ between ATen's default and avx2 paths in float64"
