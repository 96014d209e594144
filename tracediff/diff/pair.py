"""A pair of the same thing from the baseline (a) and the target (b) trace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Pair(Generic[T]):
    a: T
    b: T

    def map(self, fn: Callable[[T], U]) -> Pair[U]:
        """The same function on both sides: keeps every step symmetric over baseline and target."""
        return Pair(fn(self.a), fn(self.b))
