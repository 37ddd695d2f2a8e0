"""A device profile written for a test: a shipped one renamed, with some figures replaced."""

from __future__ import annotations

import yaml

from targets.devices import DEVICE_DIR


def device_file(tmp_path, base: str = "raspberry-pi-5", name: str = "tiny-board", **over) -> str:
    """The path of ``targets/devices/<base>.yaml`` saved as ``name`` with ``over``'s top-level keys."""
    data = yaml.safe_load((DEVICE_DIR / f"{base}.yaml").read_text())
    data.update(name=name, **over)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)
