"""A user's own piece by name: ``package.module:Name`` imported, with one error saying what could
not be imported. Algorithms, estimators and policy losses are named this way in a config."""
from __future__ import annotations

import importlib
from typing import Any


def import_named(path: str, what: str) -> Any:
    """A user's ``module:Name`` (``Name`` may be dotted: ``module:Outer.Inner``), imported;
    ``ValueError`` naming ``what`` when it cannot be. Imports nothing else (no torch), so a
    process that only needs the piece (an environment worker) starts light."""
    module, _, name = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {path!r} cannot be imported: {type(e).__name__}: {e}") from None
    return obj
