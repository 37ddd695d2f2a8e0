"""The ``executorch`` options block: every wrong value names its field and the allowed values."""

import pytest
from pydantic import ValidationError

from export.executorch.options import ExecuTorchOptions


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"quantize": "int8wo"}, "quantize\n  Input should be 'none', '8da4w' or '8da8w'"),
        ({"group_size": 0}, "group_size\n  Input should be greater than 0"),
        ({"embedding_quantize": "int2"}, "embedding_quantize\n  Input should be 'auto', 'int8' or 'int4'"),
        ({"max_seq_len": 1}, "max_seq_len\n  Input should be greater than or equal to 2"),
        ({"lm_head": "int4"}, "lm_head\n  Input should be 'same', 'fp32' or '8da8w'"),
        ({"dtype": "bfloat16"}, "dtype\n  Input should be 'float32'"),
        ({"weights": "ptd"}, "weights\n  Input should be 'embedded' or 'external'"),
        ({"max_seqlen": 64}, "unknown key 'max_seqlen' (did you mean 'max_seq_len'?)"),
    ],
)
def test_bad_options(opts, message):
    with pytest.raises(ValidationError) as err:
        ExecuTorchOptions.model_validate(opts)
    assert message in str(err.value)


def test_every_option_is_described():
    for name, field in ExecuTorchOptions.model_fields.items():
        assert field.description, name


def test_logits_option_refuses_other_values():
    with pytest.raises(ValidationError, match=r"logits\n  Input should be 'last' or 'all'"):
        ExecuTorchOptions(logits="first")  # a wrong value names the field and the choices


@pytest.mark.parametrize("field", ["fuse_projections", "split_layers", "scoring_method"])
def test_boolean_options_refuse_other_values(field):
    assert getattr(ExecuTorchOptions(), field) is (None if field == "scoring_method" else True)
    with pytest.raises(ValidationError, match=rf"{field}\n  Input should be a valid boolean"):
        ExecuTorchOptions(**{field: "sometimes"})  # a wrong value names the field and what it takes


def test_scoring_method_is_refused_beside_an_all_positions_forward():
    assert ExecuTorchOptions().scoring_method is None  # null: the pipeline decides from checks.tasks
    with pytest.raises(ValidationError, match="forward already returns every position"):
        ExecuTorchOptions(logits="all", scoring_method=True)
    assert ExecuTorchOptions(logits="all", scoring_method=False).scoring_method is False

