"""report.md's lm-eval task table: every scored row's tasks and groups in their own units, with what
each row's scoring cost. :func:`optimize.report.render_markdown` calls it with its ``Report``."""

from __future__ import annotations

from optimize.tasks.scores import format_value, unit_of


def task_lines(report, expand_groups: bool = False) -> list[str]:
    """The lm-eval task table: one column per scored row, each cell the task's headline metric in its
    own units (accuracies in points) ± its standard error. Groups show their aggregate, then their
    subgroups; their member tasks too with ``expand_groups`` (report.json always has them)."""
    rows = [r for r in report.rows if r.metrics.tasks]
    if not rows:
        return []
    every = {}
    for r in rows:
        for name, s in r.metrics.tasks.items():
            every.setdefault(name, s)

    def depth(s) -> int:
        d, p = 0, s.parent
        while p is not None and p in every:
            d, p = d + 1, every[p].parent
        return d

    shown = [n for n, s in every.items() if s.parent is None or s.kind == "group" or expand_groups]
    head = "| task | metric | items | " + " | ".join(f"{r.name} ({r.runtime})" for r in rows) + " |"
    lines = ["## Tasks (lm-eval, in each row's runtime)", head, "|---|---|---:|" + "---:|" * len(rows)]
    hidden = 0
    for name in shown:
        first = every[name]
        key = first.metric
        unit = unit_of(key)
        cells = []
        for r in rows:
            s = r.metrics.tasks.get(name)
            v = s.value(key) if s is not None else None
            if v is None:
                cells.append("–")
                continue
            e = s.value_stderr(key)
            cells.append(format_value(v, unit) + (f" ± {format_value(e, unit)}" if e is not None else ""))
        items = f"{first.items}/{first.split_items}" if first.split_items else str(first.items)
        label = "&nbsp;&nbsp;" * depth(first) + (f"**{name}**" if first.kind == "group" else name)
        shots = f", {first.num_fewshot}-shot" if first.num_fewshot else ""
        lines.append(f"| {label} | {key}{f' ({unit})' if unit and unit != 'points' else ''}{shots} | {items} | "
                     + " | ".join(cells) + " |")
        if first.kind == "group" and not expand_groups:
            hidden += sum(1 for s in every.values() if s.parent == name and s.kind == "task")
    lines += ["", "Accuracies in points, other metrics in their own units, ± standard error; data from this "
              "machine (docs/tasks.md)." + (f" {hidden} member tasks of groups are in report.json "
                                            "(checks.tasks.expand_groups lists them here)." if hidden else ""), ""]
    for r in rows:
        f = r.details.get("tasks") or {}
        if f.get("seconds") is not None:
            extra = [f"{f['reused']} reused from a shared prefix" if f.get("reused") else "",
                     f"{f['generated']} generated" if f.get("generated") else "",
                     f"{f['truncated']} requests cut to max_length {f.get('max_length')}" if f.get("truncated") else ""]
            lines.append(f"- {r.name} ({r.runtime}): {f.get('requests', 0)} requests, {f.get('tokens', 0)} tokens fed"
                         + "".join(f", {x}" for x in extra if x) + f", {f['seconds']:.1f} s")
    lines.append("")
    return lines


__all__ = ["task_lines"]
