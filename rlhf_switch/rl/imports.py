"""A user's own piece by name: ``package.module:Name`` imported, with one error saying what could
not be imported. Algorithms, estimators and policy losses are named this way in a config."""
from __future__ import annotations

import importlib
from typing import Any


def import_named(path: str, what: str) -> Any:
    """A user's ``module:Name``, imported; ``ValueError`` naming ``what`` when it cannot be."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {path!r} cannot be imported: {type(e).__name__}: {e}") from None
