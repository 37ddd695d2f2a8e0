"""The marks of a test that needs CUDA (test helper; ``tests/optimize`` is on ``sys.path``
through its conftest): ``@pytest.mark.gpu`` to select it (``-m gpu``), skipped where
``torch.cuda.is_available()`` is False, so the CPU-only suite passes and a GPU box runs them."""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
GPU = [pytest.mark.gpu, needs_cuda]
