"""Base for every config model: unknown keys are errors that list the allowed keys.

pydantic's ``extra="forbid"`` alone says "Extra inputs are not permitted" without naming
what is permitted; a typo in a YAML key deserves the list of valid keys.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = set(cls.model_fields)
            allowed |= {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [k for k in data if k not in allowed]
            if unknown:
                key = unknown[0]
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise PydanticCustomError(
                    "unknown_key",
                    "unknown key {key}{hint}; allowed keys: {allowed}",
                    {"key": repr(key), "unknown": str(key), "hint": hint, "allowed": ", ".join(sorted(allowed))},
                )
        return data
