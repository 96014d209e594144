"""Row keys from SGLang's own batch: which request each row belongs to, its position and token."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

IDLE_BATCHES = 4096  # a Req held strongly (no weak reference) is forgotten after this many idle batches


@dataclass
class Request:
    """What the scheduler knows of one request (one ``Req`` object): its name in the trace, whether
    it is recorded, and its tokens so far (prompt + output)."""

    name: str
    recorded: bool
    tokens: np.ndarray
    req: Callable[[], Any]  # the Req it tracks (a weak reference where the object allows one)
    declared: int = 0  # tokens already handed to the recorder's token table
    anchor: int | None = None  # position of its last depth-0 draft row (chain rows carry its key)
    seen: int = 0  # the batch it was last in

    def kept(self, step: int) -> bool:
        """Whether to keep tracking it: its Req lives (held weakly), or was seen lately (held strongly)."""
        if isinstance(self.req, weakref.ref):
            return self.req() is not None
        return step - self.seen < IDLE_BATCHES


def reference(req: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(req)
    except TypeError:  # a stand-in without weak references (a namedtuple): held until idle
        return lambda: req


@dataclass
class Rows:
    """Row keys of one model forward: one entry per row of the forward, in batch order."""

    step: int
    depth: int
    request: np.ndarray  # object
    position: np.ndarray
    token: np.ndarray
    keep: np.ndarray  # admitted request and known token
    last: np.ndarray  # the row index of each request's last row
    _memo: dict = dataclasses.field(default_factory=dict)

    def select(self, n: int) -> tuple[np.ndarray, dict] | None:
        """(rows of a tensor with ``n`` rows to keep, their keys), or None when ``n`` fits neither
        every row of the forward nor one row per request. Keys are the same objects for every
        tensor of the forward, so the recorder learns them once."""
        kind = "all" if n == len(self.keep) else "last" if n == len(self.last) else None
        if kind is None:
            return None
        if kind not in self._memo:
            rows = np.arange(n) if kind == "all" else self.last
            picked = np.flatnonzero(self.keep[rows])
            at = rows[picked]
            self._memo[kind] = (picked, dict(request=self.request[at], positions=self.position[at],
                                             token_ids=self.token[at]))
        return self._memo[kind]
