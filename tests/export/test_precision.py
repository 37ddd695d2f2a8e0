"""Scheme bookkeeping: eager counts and the refusal of an exported graph that lost the mix
(the exported-graph reading itself is covered by test_executorch's mixed export)."""

from __future__ import annotations

import pytest

from export.base import ExportError
from export.precision import check_mix, mix_details


def test_lost_quantization_is_refused():
    check_mix({"a": "8da4w", "b": "fp32"}, {"a": "8da4w", "b": "fp32"})
    with pytest.raises(ExportError, match=r"1 Linear layers lost their quantization.*a: 8da4w in eager, fp32"):
        check_mix({"a": "8da4w", "b": "fp32"}, {"a": "fp32", "b": "fp32"})


def test_mix_details_names_every_minority_scheme():
    d = mix_details({"a": "8da4w", "b": "8da4w", "c": "8da8w", "d": "fp32"})
    assert d == {"counts": {"8da4w": 2, "8da8w": 1, "fp32": 1}, "majority": "8da4w",
                 "modules": {"8da8w": ["c"], "fp32": ["d"]}}
    assert mix_details({}) == {"counts": {}, "modules": {}}
