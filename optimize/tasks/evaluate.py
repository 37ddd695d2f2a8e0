"""Score lm-eval tasks on a Runner: :func:`evaluate_tasks` returns one :class:`TaskScore` per task and group.

lm-eval's ``evaluator.evaluate`` does the work (documents, prompts, few-shot, filters, metrics,
group aggregation, stderr); the model is :class:`optimize.tasks.adapter.RunnerLM` and the tasks are
:func:`optimize.tasks.catalog.load_tasks`'s (lm-eval's own configs or the user's, data from this
machine). ``simple_evaluate`` is not used: it reseeds every RNG and reads git metadata; here only
the few-shot sampler is seeded, and torch's RNG state is left as it was.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Iterator, Sequence

from optimize.tasks.adapter import RunnerLM
from optimize.tasks.catalog import expand_tags, load_tasks, quiet_lm_eval
from optimize.tasks.data import SPECS, require_lm_eval
from optimize.tasks.scores import TaskScore, base_metric, pick_headline

FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


@contextlib.contextmanager
def _no_bars(progress: bool) -> Iterator[None]:
    """lm-eval draws a tqdm bar per task while building requests, one while tokenizing, and prints
    while bootstrapping a perplexity's stderr; the API is quiet unless asked. (Its log records go
    through logging, kept at ERROR by :func:`quiet_lm_eval`; an exception still propagates.)"""
    if progress:
        yield
        return
    import io

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def _numbers(res: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """lm-eval's ``"metric,filter"`` result keys -> (values, stderrs), the ``,none`` filter dropped."""
    values, errs = {}, {}
    for key, v in res.items():
        if "," not in key or isinstance(v, (str, dict, list)) or v is None:
            continue
        try:
            v = float(v)
        except (TypeError, ValueError):
            continue
        if math.isnan(v):
            continue
        metric, filt = key.split(",", 1)
        is_err = metric.endswith("_stderr")
        metric = metric[: -len("_stderr")] if is_err else metric
        name = metric if filt == "none" else f"{metric},{filt}"
        (errs if is_err else values)[name] = v
    return values, errs


def scores_from_results(out: dict, names: Sequence[str], loaded: dict, num_fewshot: int | None) -> dict[str, TaskScore]:
    """Every named task and group, each followed by its members (depth first), as TaskScores."""
    results, nsamp = out["results"], out.get("n-samples", {})
    hib_all = out.get("higher_is_better", {})
    members = out.get("group_subtasks", {}) or {}
    group_map = loaded.get("group_map") or {}
    tasks = loaded["tasks"]

    def children(name: str) -> list[str]:
        return list(group_map.get(name) or members.get(name) or [])

    def leaves(name: str) -> list[str]:
        return [name] if name in tasks else [t for child in children(name) for t in leaves(child)]

    def shots(task: str) -> int:
        n = out.get("n-shot", {}).get(task)
        return int(n) if isinstance(n, (int, float)) else (num_fewshot or 0)

    scores: dict[str, TaskScore] = {}

    def add(name: str, parent: str | None) -> None:
        res = results.get(name, {})
        values, errs = _numbers(res)
        leaf = leaves(name)
        hib = {}
        for key in values:
            flags = [((hib_all.get(t) or {}).get(base_metric(key))) for t in leaf]
            flags = [f for f in flags if f is not None]
            if flags:
                hib[key] = bool(flags[0])
        is_task = name in tasks
        items = sum(int((nsamp.get(t) or {}).get("effective", 0)) for t in leaf)
        split = sum(SPECS[t].items if t in SPECS else int((nsamp.get(t) or {}).get("original", 0)) for t in leaf)
        scores[name] = TaskScore(
            task=name, kind="task" if is_task else "group",
            output_type=getattr(tasks[name], "OUTPUT_TYPE", None) if is_task else None,
            metrics=values, stderr=errs, higher_is_better=hib, headline=pick_headline(list(values)),
            items=items, split_items=split, num_fewshot=shots(leaf[0]) if leaf else (num_fewshot or 0),
            subtasks=[] if is_task else children(name), parent=parent)
        if not is_task:
            for child in children(name):
                if child not in scores:
                    add(child, name)

    for name in names:
        add(name, None)
    return scores


def evaluate_tasks(runner, tokenizer, names: Sequence[str], *, include_path: Sequence[str] = (),
                   limit: int | None = None, num_fewshot: int | None = 0, max_length: int | None = None,
                   eos_token_ids: list[int] | None = None, progress: bool = False
                   ) -> tuple[list[TaskScore], dict]:
    """Score ``names`` (tasks and groups) on ``runner``; returns the scores (each named one followed
    by its members) and facts for the report (lm-eval version, runner calls, tokens fed, seconds).
    ``num_fewshot``: None keeps each task's own."""
    version = require_lm_eval()
    import torch
    from lm_eval import evaluator

    quiet_lm_eval()
    t0 = time.perf_counter()
    lm = RunnerLM(runner, tokenizer, max_length=max_length, progress=progress, eos_token_ids=eos_token_ids)
    # 0-shot: the built-in nine load only the items a limit scores (few-shot samples from the whole split)
    head = limit if not num_fewshot else None
    with _no_bars(progress):
        loaded = load_tasks(names, include_path, head=head)
        for task in loaded["tasks"].values():
            if num_fewshot is not None:
                task.set_config(key="num_fewshot", value=num_fewshot)
            task.set_fewshot_seed(seed=FEWSHOT_SEED)
        with torch.random.fork_rng(devices=[]):
            out = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=1000, log_samples=False,
                                     verbosity="ERROR")
    scores = scores_from_results(out, expand_tags(names, include_path), loaded, num_fewshot)
    seconds = time.perf_counter() - t0
    facts = {"lm_eval": version, "runtime": getattr(runner, "runtime", None), "max_length": lm.max_length,
             **lm.stats, "seconds": round(seconds, 2),
             "tokens_per_s": round(lm.stats["tokens"] / seconds, 1) if seconds > 0 else None}
    return list(scores.values()), facts


__all__ = ["TaskScore", "evaluate_tasks", "scores_from_results"]
