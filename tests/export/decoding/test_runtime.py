"""export/decoding/runtime.py's helpers that every decoding loop shares."""

from __future__ import annotations

import pytest
import torch

from export.decoding.runtime import argmax_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_ids_is_torch_argmax_ties_and_nan_included(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g).to(dtype)
    logits[1, 10] = logits[1, 200] = 50.0  # a tie: the first index, as torch.argmax
    logits[2, 7] = float("nan")  # NaN counts as the largest, as in torch.argmax
    logits[3] = 0.0  # all equal
    want = torch.argmax(logits, dim=-1).tolist()
    assert argmax_ids(logits) == want and want[1] == 10 and want[2] == 7 and want[3] == 0
    assert argmax_ids(logits[4]) == [want[4]]
    assert argmax_ids(logits.unsqueeze(0)) == want  # [1, T, V] as a runtime may return
