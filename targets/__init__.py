"""Deployment target profiles (data, not code): see ``targets/profiles/*.yaml``."""

from targets.profile import (
    KNOWN_SCHEMES,
    Budgets,
    TargetError,
    TargetProfile,
    list_targets,
    load_target,
    target_names,
)

__all__ = ["KNOWN_SCHEMES", "Budgets", "TargetError", "TargetProfile", "list_targets", "load_target", "target_names"]
