"""Target profiles: what a deployment target can run, as data.

A profile names the exporter and backend, the quantization schemes the backend runs
correctly, the longest sequence the exported artifact holds, and latency/size budgets that
become gates on the exported artifact. Profiles live as YAML in ``targets/profiles/``; a
user can also point at a profile file of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from targets.config_base import Strict
from targets.isa import IsaFeature

PROFILE_DIR = Path(__file__).parent / "profiles"

#: every quantization scheme name used across the project, with a one-line meaning
KNOWN_SCHEMES: dict[str, str] = {
    "fp32": "no quantization",
    "8da8w": "int8 dynamic per-token activations, int8 per-channel weights (torchao)",
    "8da4w": "int8 dynamic per-token activations, int4 group-wise weights (torchao)",
    "int8wo": "int8 weight-only (torchao)",
}


class TargetError(ValueError):
    """A target profile is unknown or malformed, or a pipeline does not suit it."""


class Budgets(Strict):
    """Limits on the exported artifact; ``None`` means no limit."""

    size_mb: float | None = Field(None, gt=0, description="largest artifact size in MiB")
    prefill_ms: float | None = Field(None, gt=0, description="slowest prefill in the runtime, ms")
    decode_tok_s: float | None = Field(None, gt=0, description="slowest acceptable decode, tokens/s")


class TargetProfile(Strict):

    name: str
    description: str
    exporter: str = Field(description="exporter that writes the artifact (export.get_exporter name)")
    backend: str = Field(description="runtime backend / execution provider")
    max_seq_len: int = Field(gt=1, description="longest prompt+generation the artifact holds")
    allowed_schemes: list[str] = Field(description="eager quantization schemes the backend runs correctly")
    refused_schemes: dict[str, str] = Field(
        default_factory=dict, description="scheme -> why this target refuses it"
    )
    requires_isa_aarch64: dict[IsaFeature, str] = Field(  # type: ignore[valid-type]
        default_factory=dict, description="arm64 ISA feature the shipped runtime build needs -> what needs it "
        "and what happens without it; a device profile whose cores lack one is refused at validate")
    budgets: Budgets = Field(default_factory=Budgets)
    export_options: dict[str, Any] = Field(
        default_factory=dict, description="defaults for the exporter's options block"
    )

    def check_scheme(self, scheme: str) -> str | None:
        """Return None if ``scheme`` suits this target, else a sentence saying why not."""
        if scheme in self.refused_schemes:
            return f"target {self.name!r} refuses scheme {scheme!r}: {self.refused_schemes[scheme]}"
        if scheme not in self.allowed_schemes:
            return (
                f"target {self.name!r} ({self.backend}) does not run scheme {scheme!r}; "
                f"allowed: {', '.join(self.allowed_schemes)}"
            )
        return None


def list_targets() -> list[TargetProfile]:
    return [load_target(p) for p in sorted(PROFILE_DIR.glob("*.yaml"))]


def target_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_target(name_or_path: str | Path) -> TargetProfile:
    """Load a bundled profile by name (``executorch``) or a profile YAML by path."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise TargetError(f"unknown target {str(name_or_path)!r}; available: {', '.join(target_names())}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise TargetError(f"target profile {path} is not valid YAML: {exc}") from None
    try:
        return TargetProfile.model_validate(data)
    except ValidationError as exc:
        lines = []
        for e in exc.errors(include_url=False):
            loc = [str(p) for p in e["loc"]] + ([e["ctx"]["unknown"]] if e["type"] == "unknown_key" else [])
            lines.append(f"  {'.'.join(loc) or '<root>'}: {e['msg']}")
        raise TargetError(f"target profile {path} is invalid:\n" + "\n".join(lines)) from None
