"""Pipeline test helpers: test-only stages via OPTIMIZE_PLUGINS and a tiny pipeline config."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
os.environ["OPTIMIZE_PLUGINS"] = "stage_plugins"

TINY_PIPELINE = {
    "version": 1,
    "name": "tiny",
    "model": {"source": "random", "config": None},
    "data": {"eval_tokens": 256, "calibration_tokens": 128, "seq_len": 128},
    # memory: the export rows' peak-RSS children (seconds each) only where a test asks for them
    # (test_predict.py, test_memory.py); test_quiet.py keeps them on to prove they are silent too
    "checks": {"latency": {"runs": 1, "warmup": 0, "decode_tokens": 4, "prompt_tokens": 16, "threads": 1},
               "memory": False},
    "stages": [],
}


@pytest.fixture()
def tiny_cfg(tmp_path, tiny_llama_config):
    """A tiny pipeline config dict writing into tmp_path; tests add stages and gates."""
    cfg = copy.deepcopy(TINY_PIPELINE)
    cfg["model"]["config"] = tiny_llama_config
    if os.environ.get("OPTIMIZE_TEST_TOKENIZER"):  # a saved tokenizer folder, where the bundled model is not installed (a GPU box)
        cfg["model"]["tokenizer"] = os.environ["OPTIMIZE_TEST_TOKENIZER"]
    cfg["output_dir"] = str(tmp_path / "run")
    return cfg
