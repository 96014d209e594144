"""The writer's book of every request's tokens: what each (request, position) holds, learned from
``request_tokens`` and from the keys of every ``log`` call (filtered-out ones included), so that a
trace knows the whole token sequence of a request even when it records only some steps.

Per request the book is sparse (sorted positions, tokens and flags: 17 bytes a known position, so a
row at position 16,000,000 costs what a row at 0 does), numpy keeps a batch of thousands of tokens
one vectorized update, and the whole book is bounded in bytes (see ``TokenBook``).
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa

KNOWN, WRITTEN, DECLARED = 1, 2, 4
MAX_POSITION = 1 << 24  # positions at or beyond are not learned (counted)
SEQUENCE_OVERHEAD = 512  # a request's objects (its arrays, dict entries) beside its entries and id


class TokenConflict(ValueError):
    """A (request, position) given two different tokens where one of them was declared with
    ``request_tokens``; raised in strict mode only (otherwise counted)."""

    def __init__(self, request: str, position: int, token_id: int, known: int) -> None:
        super().__init__(f"request {request!r} position {position}: token {token_id} conflicts with "
                         f"token {known} (one of them declared by request_tokens)")
        self.request, self.position, self.token_id, self.known = request, position, token_id, known


class _Sequence:
    """One request's tokens, sparse: sorted positions with their tokens and KNOWN / WRITTEN /
    DECLARED flags (17 bytes a known position, whatever the positions are). Rows past the last
    known position, the common case of a decoding request, append in amortized constant time."""

    __slots__ = ("pos", "token", "flags", "n", "unwritten")

    def __init__(self) -> None:
        self.pos = np.zeros(0, dtype=np.int64)
        self.token = np.zeros(0, dtype=np.int64)
        self.flags = np.zeros(0, dtype=np.uint8)
        self.n = 0  # entries in use: the arrays' first n, sorted by position
        self.unwritten = 0  # every entry before this index is written

    @property
    def nbytes(self) -> int:
        return SEQUENCE_OVERHEAD + 17 * len(self.pos)

    def _append(self, pos: np.ndarray, tok: np.ndarray, flag: int) -> None:
        end = self.n + len(pos)
        if end > len(self.pos):
            size = max(end, self.n + self.n // 4, 8)
            arrays = (self.pos, self.token, self.flags)
            self.pos, self.token, self.flags = (_grown(a, size, self.n) for a in arrays)
        self.pos[self.n:end], self.token[self.n:end], self.flags[self.n:end] = pos, tok, flag
        self.n = end

    def learn(self, name: str, position: np.ndarray, token_id: np.ndarray, declared: bool,
              strict: bool) -> tuple[int, int]:
        """Add what is new (first seen wins); returns (conflicts, positions new).
        ``strict``: raise TokenConflict, before changing anything, where a declared token is involved."""
        flag = KNOWN | (DECLARED if declared else 0)
        if len(position) == 1:
            pos, tok, inner = position, token_id, 0
        else:
            pos, first, inverse = np.unique(position, return_index=True, return_inverse=True)
            tok = token_id[first]
            inner = int((token_id != tok[inverse.reshape(-1)]).sum())  # one call, one position, two tokens
        if not self.n or pos[0] > self.pos[self.n - 1]:  # all past the end: all new
            self._append(pos, tok, flag)
            return inner, len(pos)
        held_pos = self.pos[: self.n]
        at = np.searchsorted(held_pos, pos)
        known = at < self.n
        known[known] = held_pos[at[known]] == pos[known]
        held = at[known]
        clash = self.token[held] != tok[known]
        if strict:
            bad = clash & (declared | ((self.flags[held] & DECLARED) != 0))
            if bad.any():
                i = int(np.argmax(bad))
                raise TokenConflict(name, int(pos[known][i]), int(tok[known][i]), int(self.token[held][i]))
        if declared:
            self.flags[held[~clash]] |= DECLARED
        new = ~known
        if new.any():
            where = at[new]
            self.pos = np.insert(held_pos, where, pos[new])
            self.token = np.insert(self.token[: self.n], where, tok[new])
            self.flags = np.insert(self.flags[: self.n], where, np.uint8(flag))
            self.n = len(self.pos)
            self.unwritten = min(self.unwritten, int(where[0]))
        return inner + int(clash.sum()), int(new.sum())

    def take_new(self) -> tuple[np.ndarray, np.ndarray]:
        """Positions and tokens known but not yet written; marks them written."""
        start = self.unwritten
        new = start + np.flatnonzero((self.flags[start: self.n] & WRITTEN) == 0)
        self.flags[new] |= WRITTEN
        self.unwritten = self.n
        return self.pos[new], self.token[new]


class TokenBook:
    """Thread-safe: the writer thread learns and takes; in strict mode the host thread learns too.

    Bounded by ``limit`` bytes (the Recorder passes a share of ``queue_bytes``): a request whose
    entries are all written is forgotten, least recently used first, when the book would pass it (its later
    rows are learned afresh; a conflict with what was forgotten goes unnoticed); rows that still do
    not fit are not learned and are counted in ``dropped`` (``token_rows_dropped`` in the stats)."""

    def __init__(self, limit: int = 32 << 20) -> None:
        self._lock = threading.Lock()
        self._sequences: dict[str, _Sequence] = {}
        self._dirty: dict[str, None] = {}  # requests with unwritten entries, in order
        self.limit = int(limit)
        self.nbytes = 0  # host memory the book holds (estimated from its entries and ids)
        self.conflicts = 0
        self.out_of_range = 0
        self.dropped = 0  # rows not learned: the book was at its bound
        self.forgotten = 0  # requests whose written entries left memory
        self.written = 0

    def _make_room(self, need: int) -> bool:
        """Forget fully written requests, oldest first, until ``need`` more bytes fit."""
        if self.nbytes + need <= self.limit:
            return True
        idle, freed = [], 0
        for name, sequence in self._sequences.items():  # least recently used first
            if self.nbytes - freed + need <= self.limit:
                break
            if name not in self._dirty:
                idle.append(name)
                freed += sequence.nbytes + _name_bytes(name)
        for name in idle:
            del self._sequences[name]
        self.nbytes -= freed
        self.forgotten += len(idle)
        return self.nbytes + need <= self.limit

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
                # at most every row new (and the arrays' growth): room for that, else the rows are
                # dropped (counted)
                need = 17 * len(rows) + (17 * (sequence.n // 4) if sequence is not None
                                         else SEQUENCE_OVERHEAD + _name_bytes(name))
                if not self._make_room(need):
                    self.dropped += len(rows)
                    continue
                if sequence is None:
                    sequence = self._sequences[name] = _Sequence()
                    self.nbytes += SEQUENCE_OVERHEAD + _name_bytes(name)
                elif len(self._sequences) > 1:  # most recently used last: forgetting takes the idlest
                    self._sequences[name] = self._sequences.pop(name)
                before = sequence.nbytes
                conflicts, new = sequence.learn(name, position[rows], token_id[rows], declared, strict)
                self.nbytes += sequence.nbytes - before
                self.conflicts += conflicts
                if new:
                    self._dirty[name] = None

    def has_new(self) -> bool:
        return bool(self._dirty)

    def take_new(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(request, position, token_id) of every entry not yet written, by request then position;
        None when there is none. Once taken, the entries may leave memory (see the class)."""
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


def _grown(array: np.ndarray, size: int, used: int) -> np.ndarray:
    into = np.zeros(size, array.dtype)
    into[:used] = array[:used]
    return into


def _name_bytes(name: str) -> int:
    return 64 + len(name.encode("utf-8", "surrogatepass"))


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
