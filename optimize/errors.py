"""Config errors that name the YAML path of each problem, e.g. ``stages.0.group_size``."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from pydantic import ValidationError

#: keys whose value selects a member of a discriminated union (pydantic puts it in the loc)
DISCRIMINATORS = ("kind", "source")


class ConfigError(ValueError):
    """One or more problems in a pipeline config; ``problems`` is a list of (path, message)."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]):
        self.source = source
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{source}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  {path or '<root>'}: {msg}" for path, msg in self.problems]
        super().__init__("\n".join(lines))


def yaml_path(loc: Iterable[Any], data: Any) -> str:
    """Turn a pydantic error location into a dotted YAML path, dropping union tags."""
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(node, dict) and isinstance(item, str) and item not in node:
            if any(node.get(d) == item for d in DISCRIMINATORS):
                continue  # pydantic's tag for the union member; not a key in the YAML
        parts.append(str(item))
        if isinstance(node, dict):
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
            node = node[item]
        else:
            node = None
    return ".".join(parts)


def problems_from(exc: ValidationError, data: Any, prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for err in exc.errors(include_url=False):
        path = yaml_path(err["loc"], data)
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        msg = err["msg"]
        if err["type"] == "unknown_key":
            key = err["ctx"]["unknown"]
            path = f"{path}.{key}" if path else key
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] in ("literal_error", "enum") and "expected" in err.get("ctx", {}):
            msg = f"{msg} (got {err.get('input')!r})"
        out.append((path, msg))
    return out
