"""``python -m train recipe.yaml [key.path=value ...]`` (also under ``torchrun ... -m train``).

``--check [--world-size N]`` only checks the recipe and its parallel layout against the model's
config (no weights, no ranks) and prints the resolved layout.

Exit codes: 0 done; 2 a refusal of bad input (a bad recipe, a missing file, a model or option
this run cannot take), printed as one ``error:`` line; 1 anything else, with its traceback (a
bug or a failure inside training must not read as the user's mistake; see ``train.errors``).
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
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the recipe and its parallel layout against the model (no weights loaded, nothing trained)",
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help="ranks to check the layout for (default: $WORLD_SIZE or 1)"
    )
    args = parser.parse_intermixed_args(argv)
    import os

    quiet = args.quiet or os.environ.get("RANK", "0") != "0"  # one rank's log is enough
    level = logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(message)s")
    warnings.filterwarnings("ignore", message=".*Enum subclass.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

    from train.api import check_recipe, configure_threads, run_training
    from train.errors import is_refusal
    from train.recipe import load_recipe

    configure_threads()
    from targets.quiet_imports import import_quietly

    import_quietly()  # torchao's CUDA-extension and Triton notices on a CPU host: nothing to act on
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if args.check:
            world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
            report = check_recipe(recipe, world)
        else:
            report = run_training(recipe)
    except Exception as exc:
        if not is_refusal(exc):
            raise  # a bug: the traceback and exit status 1
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(report.model_dump(mode="json"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
