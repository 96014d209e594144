"""A pair of the same thing from the baseline (a) and the target (b) trace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Pair(Generic[T]):
    a: T
    b: T

    def map(self, fn: Callable[[T], U]) -> Pair[U]:
        """The same function on both sides: keeps every step symmetric over baseline and target."""
        return Pair(fn(self.a), fn(self.b))

    def zip(self, *others: Pair) -> Pair[tuple]:
        """Side by side: Pair(a, b).zip(Pair(c, d)) is Pair((a, c), (b, d))."""
        return Pair((self.a, *(o.a for o in others)), (self.b, *(o.b for o in others)))

    @staticmethod
    def collect(pairs: list[Pair[T]]) -> Pair[list[T]]:
        """A list of pairs as a pair of lists."""
        return Pair([p.a for p in pairs], [p.b for p in pairs])

    def starmap(self: Pair[tuple[Any, ...]], fn: Callable[..., U]) -> Pair[U]:
        """``map`` over a zipped pair, each side's tuple spread into the arguments."""
        return Pair(fn(*self.a), fn(*self.b))
