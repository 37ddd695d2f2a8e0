"""A user's own lm-eval tasks, one per output type, written into a folder as a user would (task YAMLs
beside JSONL files, read through ``include_path``); shared by the task tests."""

from __future__ import annotations

import json
from pathlib import Path

#: real sentences (CPython's pydoc topics), so tokenization is the tokenizer's ordinary work
SENTENCES = [
    "The assert statement is a convenient way to insert debugging assertions into a program.",
    "Assignment statements are used to bind or rebind names to values and to modify attributes.",
    "The break statement may only occur syntactically nested in a for or while loop.",
    "A class definition is an executable statement that defines a class object.",
    "The continue statement continues with the next cycle of the nearest enclosing loop.",
    "The del statement deletes each target in the list from left to right.",
]

TICKETS = [("I was charged twice for my subscription this month.", 0),
           ("The app crashes when I open the settings page.", 1),
           ("Please add a dark mode to the editor.", 2),
           ("My invoice shows the wrong amount.", 0),
           ("Saving a file loses the last line.", 1),
           ("Could you support exporting to PDF?", 2)]

QA = [("What keyword leaves a loop early", "break"), ("What keyword skips to the next loop cycle", "continue"),
      ("What statement deletes a name", "del"), ("What statement checks a condition while debugging", "assert")]

MULTIPLE_CHOICE = """\
task: support_tickets
dataset_path: json
dataset_kwargs:
  data_files:
    test: tickets.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Ticket: {{text}}\\nCategory:"
doc_to_choice: ["billing", "bug report", "feature request"]
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

LOGLIKELIHOOD = """\
task: last_word
dataset_path: json
dataset_kwargs:
  data_files:
    test: sentences.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' '+text.split(' ')[-1]}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

ROLLING = """\
task: own_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: sentences.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

GENERATE = """\
task: keyword_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: qa.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{question}}?\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "."]
  do_sample: false
  max_gen_toks: 12
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
"""

GROUP = """\
group: support_suite
task:
  - support_tickets
  - last_word
aggregate_metric_list:
  - metric: acc
    weight_by_size: true
"""

#: task name -> output type
TASKS = {"support_tickets": "multiple_choice", "last_word": "loglikelihood", "own_text": "loglikelihood_rolling",
         "keyword_qa": "generate_until"}


def write_user_tasks(folder: Path) -> Path:
    """The four task YAMLs, a group of two of them, and their JSONL data in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in {"tickets.yaml": MULTIPLE_CHOICE, "last_word.yaml": LOGLIKELIHOOD, "own_text.yaml": ROLLING,
                       "keyword_qa.yaml": GENERATE, "support_suite.yaml": GROUP}.items():
        (folder / name).write_text(text)

    def jsonl(name, rows):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("tickets.jsonl", [{"text": t, "label": y} for t, y in TICKETS])
    jsonl("sentences.jsonl", [{"text": s} for s in SENTENCES])
    jsonl("qa.jsonl", [{"question": q, "answer": a} for q, a in QA])
    return folder


def requests_by_type(names, include_path) -> dict[str, list]:
    """lm-eval's requests for ``names`` (0-shot, every item), grouped by request type."""
    from optimize.tasks.catalog import load_tasks

    by_type: dict[str, list] = {}
    for task in load_tasks(list(names), [str(p) for p in include_path])["tasks"].values():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(rank=0, world_size=1)
        for inst in task.instances:
            by_type.setdefault(inst.request_type, []).append(inst)
    return by_type
