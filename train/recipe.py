"""Load a training recipe from YAML, with ``key.path=value`` overrides and errors that name the key.

pydantic reports locations as tuples; a user editing YAML wants ``train.optimizer.lr``,
the file name, and what was wrong, one line per problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from train.config import TrainRecipe
from train.tracking import missing_package


class RecipeError(ValueError):
    """A recipe file is missing, not YAML, or does not validate; the message names file and key."""


def _dotted(loc: tuple) -> str:
    # Discriminated unions add the tag ("random") as a location part; keep keys and indices only.
    parts = [str(p) for p in loc if not (isinstance(p, str) and p in {"hf", "gguf", "bundled", "random"})]
    return ".".join(parts) or "<root>"


def format_validation_error(exc: ValidationError, where: str) -> str:
    lines = [f"{where}: invalid training recipe ({exc.error_count()} problem{'s' * (exc.error_count() != 1)}):"]
    for err in exc.errors():
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        lines.append(f"  {_dotted(err['loc'])}: {msg}")
    return "\n".join(lines)


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Set ``a.b.c=value`` (value parsed as YAML) into ``data``; missing mappings are created."""
    for text in overrides:
        if "=" not in text:
            raise RecipeError(f"override {text!r} must look like key.path=value")
        key, raw = text.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise RecipeError(f"override {text!r} has an empty key path")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise RecipeError(f"override {text!r}: value is not valid YAML: {exc}") from None
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node, dict):
                raise RecipeError(f"override {text!r}: {'.'.join(parts[:i])} is a value, not a mapping")
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if not isinstance(node, dict):
            raise RecipeError(f"override {text!r}: {'.'.join(parts[:-1])} is a value, not a mapping")
        node[parts[-1]] = value
    return data


def parse_recipe(data: Any, where: str = "<recipe>", overrides: Sequence[str] = ()) -> TrainRecipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a YAML mapping, got {type(data).__name__}")
    apply_overrides(data, overrides)
    try:
        recipe = TrainRecipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc, where)) from None
    missing = missing_package(recipe.tracking)
    if missing:  # this machine lacks an optional package: one line, before anything loads
        raise RecipeError(f"{where}: tracking.mlflow: {missing}")
    return recipe


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> TrainRecipe:
    """Read, override and validate a recipe; every error names the file and the dotted key."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    return parse_recipe(data, str(path), overrides)
