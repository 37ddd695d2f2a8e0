"""``key=value`` overrides from the command line, applied to the YAML data before validation.

Paths are dotted, list items by index: ``stages.0.group_size=64``, ``data.eval_tokens=1024``.
Values are parsed as YAML scalars, so ``8`` is an int, ``true`` a bool, ``[a, b]`` a list.
"""

from __future__ import annotations

from typing import Any, Sequence

import yaml


class OverrideError(ValueError):
    pass


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise OverrideError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise OverrideError(f"override {text!r} has an empty key path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"override {text!r}: value is not valid YAML: {exc}") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Set each override into ``data`` (modified in place and returned).

    Missing mapping keys are created (validation then rejects unknown ones with the allowed
    list); list indices must exist, since a stage cannot be conjured from one key.
    """
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = ".".join(parts[: i + 1])
            if isinstance(node, list):
                if not part.lstrip("-").isdigit():
                    raise OverrideError(f"override {text!r}: {where} indexes a list; use a number")
                idx = int(part)
                if not -len(node) <= idx < len(node):
                    raise OverrideError(f"override {text!r}: {where} is out of range (the list has {len(node)} items)")
                if last:
                    node[idx] = value
                else:
                    node = node[idx]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:
                        node[part] = {}
                    node = node[part]
            else:
                raise OverrideError(f"override {text!r}: {'.'.join(parts[:i])} is a value, not a mapping or list")
    return data
