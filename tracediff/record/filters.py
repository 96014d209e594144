"""What a recorder keeps: name globs, every-Nth step, a set of requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Iterable

import numpy as np


@dataclass
class RecordFilter:
    """Decides cheaply, per call, whether a tensor is recorded. Name decisions are cached."""

    names: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    every: int = 1
    requests: frozenset[str] | None = None
    _name_cache: dict[str, bool] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, names: Iterable[str] | str | None = None, exclude: Iterable[str] | str | None = None,
              every: int = 1, requests: Iterable[str] | None = None) -> RecordFilter:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        return cls(
            names=_globs(names, default=("*",)),
            exclude=_globs(exclude, default=()),
            every=every,
            requests=None if requests is None else frozenset(str(r) for r in _globs(requests, default=())),
        )

    def keep_name(self, name: str) -> bool:
        keep = self._name_cache.get(name)
        if keep is None:
            keep = any(fnmatchcase(name, g) for g in self.names) and not any(
                fnmatchcase(name, g) for g in self.exclude
            )
            self._name_cache[name] = keep
        return keep

    def keep_step(self, step: int) -> bool:
        return step % self.every == 0

    def row_mask(self, requests: np.ndarray) -> np.ndarray | None:
        """Rows to keep under the request filter; None when every row is kept."""
        if self.requests is None:
            return None
        mask = np.fromiter((r in self.requests for r in requests), dtype=bool, count=len(requests))
        return None if mask.all() else mask


def _globs(value: Iterable[str] | str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    if isinstance(value, str):
        return (value,)
    return tuple(value)
