"""The user's own tasks through ``include_path``: one task per lm-eval output type, written as a user
writes them (a YAML beside a JSONL), each request equal to lm-eval's own ``HFLM`` on the eager model
(log-likelihoods within 1e-4 nats, generated strings identical), scored through ``evaluate_tasks``
with lm-eval's metrics and group aggregation, and refused early when the data is not on the machine."""

from __future__ import annotations

import math

import pytest

from export.decoding.runtime import EagerRunner
from optimize.tasks.data import missing_packages
from tests.optimize.tasks.user_tasks import SENTENCES, TASKS, requests_by_type, write_user_tasks

pytestmark = pytest.mark.skipif(bool(missing_packages()), reason="; ".join(missing_packages()))

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_lm():
    from targets.sources import RandomSource, load_model
    from tests.conftest import TINY_LLAMA

    loaded = load_model(RandomSource(config={**TINY_LLAMA, "initializer_range": 0.2}, seed=0))
    return loaded.model.eval(), loaded.tokenizer


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    return write_user_tasks(tmp_path_factory.mktemp("user") / "my_tasks")


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_every_output_type_equals_hflm_request_by_request(tiny_lm, user_dir):
    from lm_eval.models.huggingface import HFLM

    from optimize.tasks.adapter import RunnerLM

    model, tok = tiny_lm
    reqs = requests_by_type(TASKS, [user_dir])
    assert set(reqs) == {"loglikelihood", "loglikelihood_rolling", "generate_until"}
    ours = RunnerLM(EagerRunner(model), tok, max_length=48, eos_token_ids=[tok.eos_token_id])
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu", max_length=48)
    # multiple choice (18 requests) and the last word (6) are both loglikelihood requests
    a, b = ours.loglikelihood(reqs["loglikelihood"]), ref.loglikelihood(reqs["loglikelihood"], disable_tqdm=True)
    assert len(a) == 24 and max(abs(x[0] - y[0]) for x, y in zip(a, b)) < TOL
    assert [x[1] for x in a] == [y[1] for y in b]
    # rolling windows of 48 tokens: the long sentences take two windows each
    a, b = ours.loglikelihood_rolling(reqs["loglikelihood_rolling"]), ref.loglikelihood_rolling(
        reqs["loglikelihood_rolling"], disable_tqdm=True)
    assert len(a) == 6 and max(abs(x - y) for x, y in zip(a, b)) < TOL
    gen = reqs["generate_until"]
    a, b = ours.generate_until(gen), ref.generate_until(gen, disable_tqdm=True)
    assert a == b and len(a) == 4 and any(a)  # the same strings, cut at the same stop sequence
    assert ours.stats["generated"] > 0


def test_include_path_scores_with_lm_evals_metrics_and_group_aggregate(tiny_lm, user_dir):
    from optimize.tasks.adapter import RunnerLM
    from optimize.tasks.evaluate import evaluate_tasks

    model, tok = tiny_lm
    scores, facts = evaluate_tasks(EagerRunner(model), tok, ["support_suite", "own_text", "keyword_qa"],
                                   include_path=[str(user_dir)], max_length=48)
    s = {x.task: x for x in scores}
    assert list(s) == ["support_suite", "support_tickets", "last_word", "own_text", "keyword_qa"]
    group, mc, lw = s["support_suite"], s["support_tickets"], s["last_word"]
    assert group.kind == "group" and group.subtasks == ["support_tickets", "last_word"] and group.items == 12
    assert mc.parent == lw.parent == "support_suite" and mc.output_type == "multiple_choice"
    # lm-eval's size-weighted mean of the members' accuracy
    assert group.metrics["acc"] == pytest.approx((6 * mc.metrics["acc"] + 6 * lw.metrics["acc"]) / 12, abs=1e-12)
    assert lw.metric == "acc" and lw.better_high("perplexity") is False and lw.metrics["perplexity"] > 1
    # bits per byte from our own rolling log-likelihoods (1e-9): the metric is lm-eval's over our numbers
    rolled = s["own_text"]
    assert rolled.metric == "word_perplexity" and rolled.output_type == "loglikelihood_rolling"
    from lm_eval.api.instance import Instance

    lls = RunnerLM(EagerRunner(model), tok, max_length=48).loglikelihood_rolling(
        [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=0) for t in SENTENCES])
    nbytes = sum(len(t.encode()) for t in SENTENCES)
    assert rolled.metrics["bits_per_byte"] == pytest.approx(-sum(lls) / nbytes / math.log(2), rel=1e-9)
    assert rolled.value("bits_per_byte") == rolled.metrics["bits_per_byte"]  # its own units, not points
    gen = s["keyword_qa"]
    assert gen.metric == "exact_match,first_word" and 0 <= gen.score <= 100 and gen.items == 4
    assert facts["generated"] > 0 and facts["tokens"] > 0 and facts["seconds"] > 0


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_validate_refuses_what_cannot_be_scored_offline(tiny_cfg, user_dir, tmp_path):
    from optimize.config import ConfigError, load_config

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "gone.yaml").write_text((user_dir / "tickets.yaml").read_text().replace("support_tickets", "gone")
                                   .replace("tickets.jsonl", "missing.jsonl"))
    (bad / "sampled.yaml").write_text((user_dir / "keyword_qa.yaml").read_text().replace("keyword_qa", "sampled")
                                      .replace("do_sample: false", "do_sample: true\n  temperature: 0.8")
                                      .replace("qa.jsonl", str(user_dir / "qa.jsonl")))
    tiny_cfg["checks"]["tasks"] = {"names": ["lambada_openai", "hellaswagg", "gone", "sampled", "mmlu"],
                                   "include_path": [str(bad)]}
    with pytest.raises(ConfigError) as err:
        load_config(tiny_cfg, check_model=False)
    msg = str(err.value)
    assert "checks.tasks.names" in msg
    assert "lambada_openai would download EleutherAI/lambada_openai (config default) from the Hugging Face Hub" in msg
    assert "unknown task 'hellaswagg'" in msg and "did you mean hellaswag" in msg
    assert "gone: data file" in msg and "missing.jsonl" in msg
    assert "sampled samples its generations" in msg
    assert "mmlu" not in msg.replace("'mmlu'", "")  # MMLU's data is in the wheel: accepted
    # a task both named and inside a named group; a gate on a metric the task does not have
    tiny_cfg["checks"]["tasks"] = {"names": ["support_suite", "last_word"], "include_path": [str(user_dir)]}
    tiny_cfg["gates"] = {"tasks": {"support_tickets": {"metric": "f1", "threshold": 10}}}
    with pytest.raises(ConfigError) as err:
        load_config(tiny_cfg, check_model=False)
    msg = str(err.value)
    assert "last_word is part of both support_suite and last_word" in msg
    assert "gates.tasks.support_tickets.metric" in msg and "it has: acc" in msg


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_include_path_is_relative_to_the_config_file(tiny_cfg, user_dir, tmp_path):
    import yaml

    from optimize.config import load_config

    tiny_cfg["checks"]["tasks"] = {"names": ["own_text"], "include_path": ["tasks_here"]}
    cfg_dir = tmp_path / "project"
    write_user_tasks(cfg_dir / "tasks_here")
    (cfg_dir / "run.yaml").write_text(yaml.safe_dump(tiny_cfg))
    cfg = load_config(cfg_dir / "run.yaml", check_model=False)
    assert cfg.checks.tasks.include_path == [str((cfg_dir / "tasks_here").resolve())]


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_csv_and_saved_folders_score_as_the_jsonl_does(tiny_lm, user_dir, tmp_path):
    """The same tickets as CSV (dataset_path: csv) and as a save_to_disk folder (dataset_path: the
    folder) give the JSONL task's scores exactly."""
    import datasets

    from optimize.tasks.evaluate import evaluate_tasks
    from tests.optimize.tasks.user_tasks import TICKETS

    folder = tmp_path / "formats"
    folder.mkdir()
    (folder / "tickets.csv").write_text("text,label\n" + "".join(f'"{t}",{y}\n' for t, y in TICKETS))
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"text": t, "label": y} for t, y in TICKETS])}) \
        .save_to_disk(str(folder / "saved"))
    base = (user_dir / "tickets.yaml").read_text()
    (folder / "csv.yaml").write_text(base.replace("support_tickets", "tickets_csv").replace("tickets.jsonl", "tickets.csv")
                                     .replace("dataset_path: json", "dataset_path: csv"))
    saved = base.replace("support_tickets", "tickets_saved").replace("dataset_path: json", f"dataset_path: {folder / 'saved'}")
    saved = saved.replace("dataset_kwargs:\n  data_files:\n    test: tickets.jsonl\n", "")
    (folder / "saved.yaml").write_text(saved)
    model, tok = tiny_lm
    scores, _ = evaluate_tasks(EagerRunner(model), tok, ["support_tickets", "tickets_csv", "tickets_saved"],
                               include_path=[str(user_dir), str(folder)], max_length=48)
    by = {s.task: s for s in scores}
    assert by["tickets_csv"].metrics == by["tickets_saved"].metrics == by["support_tickets"].metrics
    assert by["tickets_saved"].items == 6


def test_ls_tasks_lists_what_can_be_scored_offline(user_dir, capsys):
    import argparse

    from optimize.cli import cmd_ls
    from optimize.tasks.catalog import local_tasks

    rows = {r["name"]: r for r in local_tasks([str(user_dir)])}
    assert rows["support_tickets"]["data"].startswith("include_path") and rows["support_suite"]["kind"] == "group"
    assert rows["mmlu"] == {"name": "mmlu", "kind": "group", "output_type": "", "data": "57 tasks with local data"}
    assert rows["nq_open"]["output_type"] == "generate_until" and rows["mmlu_anatomy"]["data"].endswith("anatomy")
    assert "lambada_openai" not in rows and "wikitext" not in rows  # their data is not on the machine
    assert cmd_ls(argparse.Namespace(what="tasks", include_path=[str(user_dir)])) == 0
    out = capsys.readouterr().out
    assert "keyword_qa" in out and "generate_until" in out and "tasks and groups with their data on this machine" in out
