"""Built-in stages. Each module registers one kind with ``@register_stage``; importing this
package registers them all. Add a new stage by adding its module to ``BUILTIN`` below."""

import importlib

BUILTIN = ["ptq_int8", "rmsnorm", "gqa", "rotate", "smoothquant", "awq", "distill", "qat", "prune"]

for _name in BUILTIN:
    importlib.import_module(f"optimize.stages.{_name}")
