"""Fixtures shared by the export tests."""

from __future__ import annotations

import pytest


class _Tok:
    """The tokenizer fields the ExecuTorch metadata reads, for models without a real tokenizer."""

    bos_token_id, eos_token_id, vocab_file = 1, 2, ""


@pytest.fixture()
def lower_variants(tmp_path):
    """``lower(model, field, **common)``: the model lowered to a ``.pte`` once with the ExecuTorch
    option ``field`` true and once false; returns ``(runners, details)`` keyed by that value."""
    from export.executorch import ExecuTorchOptions, lower_to_pte
    from export.executorch_runtime import ExecuTorchRunner

    def lower(model, field: str, **common):
        runners, details = {}, {}
        for value in (True, False):
            opts = ExecuTorchOptions(**common, **{field: value})
            data, details[value] = lower_to_pte(model, _Tok(), opts, log=lambda *_: None)
            (tmp_path / f"{field}-{value}.pte").write_bytes(data)
            runners[value] = ExecuTorchRunner(tmp_path / f"{field}-{value}.pte")
        return runners, details

    return lower
