"""Refusals of bad input versus bugs: the rule behind exit status 2 versus a traceback and 1."""

from __future__ import annotations

import pytest
import torch

from train.errors import TrainInputError, is_refusal


def _raised(fn, *args, **kwargs) -> BaseException:
    with pytest.raises(BaseException) as info:
        fn(*args, **kwargs)
    return info.value


def test_project_error_classes_and_missing_files_are_refusals():
    from train.recipe import RecipeError

    assert is_refusal(RecipeError("r.yaml: invalid training recipe"))
    assert is_refusal(TrainInputError("device: cuda was requested but CUDA is not available"))
    assert is_refusal(FileNotFoundError("recipe not found"))


def test_a_value_error_our_code_raises_on_purpose_is_a_refusal():
    from train.config import OptimizerConfig
    from train.optim import build_optimizer

    exc = _raised(build_optimizer, [], OptimizerConfig(), torch.device("cpu"))
    assert type(exc) is ValueError and "no trainable parameters" in str(exc)
    assert is_refusal(exc)


def test_implicit_and_library_errors_are_bugs(monkeypatch):
    """The same exception types raised implicitly in our code, or by a library, keep their traceback."""
    from train.config import DistributedConfig
    from train.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "two")
    implicit = _raised(init_distributed, "cpu", DistributedConfig())  # int("two") inside train/
    assert type(implicit) is ValueError and "invalid literal" in str(implicit)
    assert not is_refusal(implicit)

    def unpack(outputs):  # what torchao's NF4Tensor did under FSDP2 on one rank
        a, b, c = outputs

    assert not is_refusal(_raised(unpack, (1,)))
    assert not is_refusal(_raised(int, "x"))
    assert not is_refusal(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_refusal(ValueError("constructed but never raised"))


def test_an_explicit_runtime_error_of_ours_is_still_a_bug():
    """Only our error classes and our ValueError/TypeError refusals get one line: an out-of-memory
    that cannot shrink further is a failure, not the user's typo."""
    from train.batching import MicroBatchPlan
    from train.config import BatchConfig

    plan = MicroBatchPlan(BatchConfig(micro_batch_size=1))
    exc = _raised(plan.shrink, RuntimeError("CUDA out of memory"))
    assert type(exc) is RuntimeError and not is_refusal(exc)
