"""The one error every model source raises, so callers catch one type."""

from __future__ import annotations


class ModelSourceError(ValueError):
    """A model could not be found or loaded; the message names the file or package."""
