"""The int4 group-size rules, checked in one place for ptq_int8, awq, qat, sensitivity and the
ExecuTorch exporter."""

from __future__ import annotations

from targets.group_size import (
    embedding_group_size_error,
    embedding_width_error,
    fitting_group_sizes,
    group_size_error,
    widths_error,
)


def test_linear_group_size_is_a_multiple_of_32():
    assert group_size_error(32) is None and group_size_error(256) is None
    assert group_size_error(48) == ("group_size=48 is not a multiple of 32: XNNPACK's 4-bit kernels need whole "
                                    "32-channel blocks (typical: 32, 64, 128, 256)")
    assert group_size_error(0) is not None and group_size_error(16) is not None


def test_widths_name_the_layers_and_what_fits():
    widths = {"a.q_proj": 576, "a.down_proj": 1536, "lm_head": 576}
    assert widths_error(64, widths) is None
    assert fitting_group_sizes(widths) == [32, 64]
    msg = widths_error(128, widths)
    assert msg == ("group_size=128 does not divide the in_features of 2 layer(s), e.g. a.q_proj (in_features=576), "
                   "lm_head (in_features=576); group sizes that fit every layer: 32, 64")
    odd = widths_error(32, {"x": 80}, key="stages.0.group_size")
    assert odd.startswith("stages.0.group_size=32 does not divide the in_features of 1 layer(s), e.g. x (in_features=80)")
    assert odd.endswith("none of [32, 64, 128, 256] (keep the odd layers in higher precision)")


def test_embedding_group_size_is_even_and_divides_the_width():
    assert embedding_group_size_error(32) is None
    assert embedding_group_size_error(7) == "embedding_group_size=7 must be even (two int4 values pack into a byte)"
    assert embedding_width_error(32, 576) is None
    assert embedding_width_error(48, 64) == "embedding_group_size=48 does not divide the embedding width 64; choose one that does (e.g. 32)"
    assert embedding_width_error(7, 64).startswith("embedding_group_size=7 must be even")
