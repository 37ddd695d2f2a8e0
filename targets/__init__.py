"""Deployment target profiles (data, not code): see ``targets/profiles/*.yaml``.

Also the leaf of the package graph: ``targets.config_base`` (the strict config base) and
``targets.atomic`` (atomic file I/O) are used by ``export``, ``train`` and ``optimize`` alike.
"""

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
