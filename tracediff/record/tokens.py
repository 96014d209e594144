"""The writer's book of every request's tokens: what each (request, position) holds, learned from
``request_tokens`` and from the keys of every ``log`` call (filtered-out ones included), so that a
trace knows the whole token sequence of a request even when it records only some steps.

Per request the book is dense (a token and a flags byte per position, 9 bytes a token): positions
are 0..len-1 by nature, and numpy keeps a batch of thousands of tokens one vectorized update.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa

KNOWN, WRITTEN, DECLARED = 1, 2, 4
MAX_POSITION = 1 << 24  # positions at or beyond are not learned (counted): the book is dense


class TokenConflict(ValueError):
    """A (request, position) given two different tokens where one of them was declared with
    ``request_tokens``; raised in strict mode only (otherwise counted)."""

    def __init__(self, request: str, position: int, token_id: int, known: int) -> None:
        super().__init__(f"request {request!r} position {position}: token {token_id} conflicts with "
                         f"token {known} (one of them declared by request_tokens)")
        self.request, self.position, self.token_id, self.known = request, position, token_id, known


class _Sequence:
    """One request's tokens by position, with KNOWN / WRITTEN / DECLARED flags."""

    __slots__ = ("token", "flags")

    def __init__(self) -> None:
        self.token = np.zeros(0, dtype=np.int64)
        self.flags = np.zeros(0, dtype=np.uint8)

    def _reserve(self, size: int) -> None:
        if size <= len(self.token):
            return
        size = max(size, 2 * len(self.token), 64)
        token, flags = np.zeros(size, np.int64), np.zeros(size, np.uint8)
        token[: len(self.token)], flags[: len(self.flags)] = self.token, self.flags
        self.token, self.flags = token, flags

    def learn(self, name: str, position: np.ndarray, token_id: np.ndarray, declared: bool,
              strict: bool) -> tuple[int, bool]:
        """Add what is new (first seen wins); returns (conflicts, whether anything was new).
        ``strict``: raise TokenConflict, before changing anything, where a declared token is involved."""
        pos, first, inverse = np.unique(position, return_index=True, return_inverse=True)
        tok = token_id[first]
        inner = int((token_id != tok[inverse.reshape(-1)]).sum())  # one call, one position, two tokens
        self._reserve(int(pos[-1]) + 1)
        flags = self.flags[pos]
        known = (flags & KNOWN) != 0
        clash = known & (self.token[pos] != tok)
        if strict:
            bad = clash & (declared | ((flags & DECLARED) != 0))
            if bad.any():
                i = int(np.argmax(bad))
                raise TokenConflict(name, int(pos[i]), int(tok[i]), int(self.token[pos[i]]))
        new = ~known
        self.token[pos[new]] = tok[new]
        self.flags[pos[new]] = KNOWN | (DECLARED if declared else 0)
        if declared:
            self.flags[pos[known & ~clash]] |= DECLARED
        return inner + int(clash.sum()), bool(new.any())

    def take_new(self) -> tuple[np.ndarray, np.ndarray]:
        """Positions and tokens known but not yet written; marks them written."""
        new = np.flatnonzero((self.flags & (KNOWN | WRITTEN)) == KNOWN)
        self.flags[new] |= WRITTEN
        return new.astype(np.int64), self.token[new]


class TokenBook:
    """Thread-safe: the writer thread learns and takes; in strict mode the host thread learns too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sequences: dict[str, _Sequence] = {}
        self._dirty: dict[str, None] = {}  # requests with unwritten entries, in order
        self.conflicts = 0
        self.out_of_range = 0
        self.written = 0

    def learn(self, request: np.ndarray, position: np.ndarray, token_id: np.ndarray, declared: bool = False,
              strict: bool = False) -> None:
        """Learn one (request, position, token_id) per row; padded rows (position < 0) say nothing."""
        usable = (position >= 0) & (position < MAX_POSITION)
        with self._lock:
            self.out_of_range += int((position >= MAX_POSITION).sum())
            if not usable.all():
                request, position, token_id = request[usable], position[usable], token_id[usable]
            for name, rows in _by_request(request):
                sequence = self._sequences.get(name)
                if sequence is None:
                    sequence = self._sequences[name] = _Sequence()
                conflicts, new = sequence.learn(name, position[rows], token_id[rows], declared, strict)
                self.conflicts += conflicts
                if new:
                    self._dirty[name] = None

    def has_new(self) -> bool:
        return bool(self._dirty)

    def take_new(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(request, position, token_id) of every entry not yet written, by request then position;
        None when there is none."""
        with self._lock:
            taken = [(name, *self._sequences[name].take_new()) for name in self._dirty]
            self._dirty.clear()
        taken = [t for t in taken if len(t[1])]
        if not taken:
            return None
        request = np.repeat(np.array([t[0] for t in taken], dtype=object), [len(t[1]) for t in taken])
        position = np.concatenate([t[1] for t in taken])
        self.written += len(position)
        return request, position, np.concatenate([t[2] for t in taken])


def _by_request(request: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Row numbers of each distinct request, in order of first appearance."""
    if not len(request):
        return []
    if request[0] == request[-1] and (len(request) < 3 or (request == request[0]).all()):
        return [(str(request[0]), np.arange(len(request)))]
    encoded = pa.array(request, type=pa.string()).dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    return list(zip(encoded.dictionary.to_pylist(), np.split(order, bounds)))
