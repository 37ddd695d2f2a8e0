"""The ground floor: where a run starts from, where it ships to, and what every package stands on.

- Where it starts from: :mod:`targets.sources` (model and text sources) and
  :mod:`targets.user_cache` (the user cache: GGUF conversions, the digests caches key on).
- Where it ships to: the target profiles (``targets/profiles/*.yaml``, read by
  :mod:`targets.profile`, exported here), the device profiles (:mod:`targets.devices`) and the
  int4 group-size rules (:mod:`targets.group_size`).
- The basics: :mod:`targets.config_base` (``Strict``), :mod:`targets.atomic` (atomic writes,
  cache locks), :mod:`targets.process_memory`, :mod:`targets.quiet_imports`.

It imports nothing from ``train``, ``export`` or ``optimize``; they all import it.
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
