"""Row alignment by content: two rows correspond when their requests hold the same tokens from
position 0 up to the row's position, at the same position and draft depth; producer request ids,
steps and batching do not matter. A draft row at depth d > 0 is comparable only where both sides
fed the draft the same tokens at depths 1..d.

Everything works on key-column arrays (no per-row Python objects): a token prefix is named by a
64-bit polynomial hash of its tokens, equal across traces, and rows are matched by sorting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.pair import Pair
from tracediff.trace.reader import KeyColumns, RowKeys, Trace

FED = "draft.input_ids"
BASE = np.uint64(0x100000001B3)  # odd, so invertible mod 2**64: prefix hashes come from one cumsum
MIX_POSITION, MIX_DEPTH = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)


@dataclass
class Prefixes:
    """Per (request, position): the id of the token prefix x[0..position], equal across traces.

    ``where`` holds request code (the trace's ``request_code``) * stride + position, sorted;
    ``ids`` and ``tokens`` follow it. Positions after a gap have no id (their prefix is unknown)."""

    names: dict[int, str]  # request code -> request id
    stride: int
    where: np.ndarray
    ids: np.ndarray  # uint64
    tokens: np.ndarray

    @classmethod
    def of(cls, keys: list[KeyColumns]) -> Prefixes:
        """From the depth-0 rows of every tensor of one trace (key columns only); the first token
        seen at a (request, position) counts."""
        parts = [(k.request_code[s], k.position[s], k.token_id[s]) for k in keys for s in [k.depth == 0]]
        parts = parts or [(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))]
        codes, positions, tokens = (np.concatenate(column) for column in zip(*parts))
        names: dict[int, str] = {}
        for k in keys:
            found, at = np.unique(k.request_code, return_index=True)
            names.update(zip(found.tolist(), k.request[at].tolist()))
        stride = int(positions.max(initial=0)) + 2
        where, first = np.unique(codes * stride + positions, return_index=True)
        code, position, token = where // stride, where % stride, tokens[first]
        keep = _no_gap(code, position)  # each request's positions 0, 1, 2, ... up to its first gap
        where, code, position, token = where[keep], code[keep], position[keep], token[keep]
        return cls(names=names, stride=stride, where=where, ids=_prefix_hashes(code, position, token),
                   tokens=token)

    def lookup(self, codes: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, found) of the prefixes of these requests (by code) up to these positions."""
        inside = (codes >= 0) & (positions >= 0) & (positions < self.stride)
        at, found = _find_sorted(self.where, np.where(inside, codes * self.stride + positions, -1))
        found &= inside
        return np.where(found, self.ids[at], 0).astype(np.uint64), found


@dataclass
class Matched:
    """Row indices of one tensor name on both sides that correspond, in baseline row order."""

    rows: Pair[np.ndarray]
    not_comparable: int  # depth > 0 rows whose fed tokens differ between the sides


def key_of(ids: np.ndarray, positions: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """One uint64 per (prefix id, position, depth)."""
    with np.errstate(over="ignore"):
        return (ids.astype(np.uint64) ^ (positions.astype(np.uint64) * MIX_POSITION)
                ^ (depths.astype(np.uint64) * MIX_DEPTH))


def row_keys(rows: KeyColumns, prefixes: Prefixes) -> tuple[np.ndarray, np.ndarray]:
    """(key, found) per row: ``key_of`` its prefix, position and depth."""
    ids, found = prefixes.lookup(rows.request_code, rows.position)
    return key_of(ids, rows.position, rows.depth), found


@dataclass
class RowIndex:
    """The first row of each key of one side, sorted by key: finds rows by key."""

    keys: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, rows: KeyColumns, prefixes: Prefixes) -> RowIndex:
        keys, found = row_keys(rows, prefixes)
        first = _first_rows(keys, found)
        return cls(keys[first], first)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The row holding each key, or -1."""
        at, found = _find_sorted(self.keys, keys)
        return np.where(found, self.rows[at], -1)


def match(rows: Pair[RowKeys], prefixes: Pair[Prefixes], fed: Pair[FedTokens] | None = None) -> Matched:
    """Pair up rows with equal (prefix, position, depth); the first occurrence on each side wins."""
    first_a = RowIndex.of(rows.a, prefixes.a)
    found = RowIndex.of(rows.b, prefixes.b).find(first_a.keys)
    a_idx, b_idx = first_a.rows[found >= 0], found[found >= 0]
    order = np.argsort(a_idx, kind="stable")
    a_idx, b_idx = a_idx[order], b_idx[order]
    skipped = 0
    if fed is not None:
        same = _same_feed(rows.a, a_idx, prefixes.a, fed)
        skipped = int((~same).sum())
        a_idx, b_idx = a_idx[same], b_idx[same]
    return Matched(rows=Pair(a_idx, b_idx), not_comparable=skipped)


def match_by_step(rows: Pair[RowKeys]) -> Matched:
    """``--align step``: the i-th row of a step and depth on one side pairs with the i-th row of the
    same step and depth on the other (same producer, same batching: before vs after a change)."""
    def keyed(r: RowKeys) -> dict[tuple, int]:
        seen: dict[tuple, int] = {}
        out: dict[tuple, int] = {}
        for i, (step, depth) in enumerate(zip(r.step.tolist(), r.depth.tolist())):
            n = seen.get((step, depth), 0)
            seen[(step, depth)] = n + 1
            out[(step, depth, n)] = i
        return out

    keys = rows.map(keyed)
    common = [k for k in keys.a if k in keys.b]
    return Matched(rows=Pair(np.array([keys.a[k] for k in common], dtype=np.int64),
                             np.array([keys.b[k] for k in common], dtype=np.int64)), not_comparable=0)


@dataclass
class FedTokens:
    """The token fed to the draft (``draft.input_ids``) per row key."""

    index: RowIndex
    values: np.ndarray  # per row of draft.input_ids

    def at(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, found) at these row keys."""
        rows = self.index.find(keys)
        found = rows >= 0
        if not len(self.values):
            return np.zeros(len(keys), np.int64), found
        return self.values[np.where(found, rows, 0)], found


def fed_tokens(trace: Trace, keys: RowKeys | None, prefixes: Prefixes) -> FedTokens:
    if keys is None:
        return FedTokens(RowIndex(np.zeros(0, np.uint64), np.zeros(0, np.int64)), np.zeros(0, np.int64))
    values = trace.gather(keys).reshape(len(keys), -1)[:, 0].astype(np.int64)
    return FedTokens(RowIndex.of(keys, prefixes), values)


def first_token_difference(prefixes: Pair[Prefixes]) -> dict | None:
    """Where a target request's tokens first leave every baseline request (a different chat
    template, say): the request, the position and both tokens there. None when every target
    request is a prefix of, or extends, some baseline request."""
    a, b = prefixes.a, prefixes.b
    known = np.isin(b.ids, a.ids)
    # a's token after each of its prefixes: parent id (0 for the empty prefix) -> next token
    parent_a = _parents(a)
    order = np.argsort(parent_a, kind="stable")
    parents_sorted, next_sorted = parent_a[order], a.tokens[order]
    at, found = _find_sorted(parents_sorted, _parents(b))
    for i in np.flatnonzero(~known & found).tolist():
        code, position = divmod(int(b.where[i]), b.stride)
        if not position or known[i - 1]:  # the first prefix of its request that a lacks
            return {"request_b": b.names[code], "position": position, "a": int(next_sorted[at[i]]),
                    "b": int(b.tokens[i])}
    return None


def _same_feed(rows: RowKeys, picked: np.ndarray, prefixes: Prefixes, fed: Pair[FedTokens]) -> np.ndarray:
    """For picked rows: every depth 1..d of the row's chain was fed the same token on both sides."""
    depth = rows.depth[picked]
    same = np.ones(len(picked), bool)
    ids, _ = prefixes.lookup(rows.request_code[picked], rows.position[picked])
    for d in range(1, int(depth.max(initial=0)) + 1):
        deep = depth >= d
        keys = key_of(ids[deep], rows.position[picked][deep], np.full(int(deep.sum()), d))
        (tok_a, in_a), (tok_b, in_b) = fed.a.at(keys), fed.b.at(keys)
        same[deep] &= in_a & in_b & (tok_a == tok_b)
    return same


def _find_sorted(sorted_keys: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, found) of each wanted key in a sorted array; index is valid where found."""
    if not len(sorted_keys):
        return np.zeros(len(wanted), np.int64), np.zeros(len(wanted), bool)
    at = np.minimum(np.searchsorted(sorted_keys, wanted), len(sorted_keys) - 1)
    return at, sorted_keys[at] == wanted


def _group_starts(code: np.ndarray) -> np.ndarray:
    """Where each run of equal codes (one request, sorted) begins."""
    return np.flatnonzero(np.r_[True, code[1:] != code[:-1]])


def _first_rows(keys: np.ndarray, found: np.ndarray) -> np.ndarray:
    """Indices of the first row of each distinct key among found rows, sorted by key."""
    candidates = np.flatnonzero(found)
    _, first = np.unique(keys[candidates], return_index=True)
    return candidates[first]


def _no_gap(code: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Rows (sorted by request, then position) before their request's first missing position."""
    if not len(code):
        return np.zeros(0, bool)
    start = _group_starts(code)
    lengths = np.diff(np.r_[start, len(code)])
    rank = np.arange(len(code)) - np.repeat(start, lengths)
    broken = (position != rank).astype(np.int64)
    # a request is cut at its first broken row: count broken rows so far within the request
    so_far = np.cumsum(broken) - np.repeat(np.cumsum(broken)[start] - broken[start], lengths)
    return so_far == 0


def _prefix_hashes(code: np.ndarray, position: np.ndarray, token: np.ndarray) -> np.ndarray:
    """h(p) = sum over i <= p of s(token_i) * BASE**(p - i) mod 2**64, per request: a running
    hash as BASE**p * cumsum(s(token_i) * BASE**-i), all in wrapping uint64 arithmetic. s scrambles
    each token to 64 pseudo-random bits, so structured token strings do not collide."""
    if not len(code):
        return np.zeros(0, np.uint64)
    with np.errstate(over="ignore"):
        top = int(position.max()) + 1
        powers = np.r_[np.uint64(1), np.cumprod(np.full(top - 1, BASE, dtype=np.uint64))]
        inverse = np.r_[np.uint64(1), np.cumprod(np.full(top - 1, _inverse(BASE), dtype=np.uint64))]
        terms = _scramble(token.astype(np.uint64)) * inverse[position]
        running = np.cumsum(terms, dtype=np.uint64)
        start = _group_starts(code)
        before = np.repeat(running[start] - terms[start], np.diff(np.r_[start, len(code)]))
        return (running - before) * powers[position]


def _scramble(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 that spreads every input bit."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _inverse(x: np.uint64) -> np.uint64:
    """x**-1 mod 2**64 for odd x (Newton's iteration doubles the correct bits each step)."""
    y = 1
    for _ in range(6):
        y = y * (2 - int(x) * y) % (1 << 64)
    return np.uint64(y)


def _parents(prefixes: Prefixes) -> np.ndarray:
    """The id of x[0..p-1] for each entry (0 at position 0)."""
    position = prefixes.where % prefixes.stride
    parent = np.zeros(len(prefixes.ids), np.uint64)
    inner = np.flatnonzero(position > 0)
    parent[inner] = prefixes.ids[inner - 1]  # sorted by (request, position), no gaps: the entry before
    return parent
