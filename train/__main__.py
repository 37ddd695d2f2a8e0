"""``python -m train recipe.yaml [key.path=value ...]`` (also under ``torchrun ... -m train``).

Exit codes: 0 done, 2 bad recipe or input, 1 training failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description="Train a causal LM from a YAML recipe.")
    parser.add_argument("recipe", help="recipe YAML (see examples/train/)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.max_steps=10")
    parser.add_argument("--quiet", action="store_true", help="log warnings only (the JSON report still goes to stdout)")
    args = parser.parse_intermixed_args(argv)
    import os

    quiet = args.quiet or os.environ.get("RANK", "0") != "0"  # one rank's log is enough
    level = logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(message)s")
    warnings.filterwarnings("ignore", message=".*Enum subclass.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

    from train.api import configure_threads, run_training
    from train.recipe import RecipeError, load_recipe

    configure_threads()
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        report = run_training(recipe)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(report.model_dump(mode="json"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
