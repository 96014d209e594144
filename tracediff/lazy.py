"""Names a package exports but loads on first use: ``__getattr__ = lazy(__name__, {name: module})``.

One home for the pattern: ``tracediff``, ``tracediff.trace`` and ``tracediff.integrations.sglang``
import nothing heavy at start (``tests/test_startup.py``); each name is imported once, then kept in
the package's namespace, so later lookups are plain attribute reads."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table`` maps each name to the module (absolute, or
    relative to ``package`` when it starts with a dot) that defines it."""
    def getattr_(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return getattr_
