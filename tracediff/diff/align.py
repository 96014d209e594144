"""Row alignment by content: two rows correspond when their requests hold the same tokens from
position 0 up to the row's position, at the same position and draft depth; producer request ids,
steps and batching do not matter. The tokens of a request come from its declared / learned token
table (format v2) and from the rows themselves, so a row that starts at position k > 0 (prefix
cache hit, chunked prefill, sampled steps) still has a known prefix. A draft row at depth d > 0
pairs by the token fed at depth d too, and is comparable only where both sides fed the draft the
same tokens at depths 1..d. A row is keyed by everything it depends on: a draft row (at depth 0 a
tensor that ``reads_fed_token``, at depth > 0 every one) by the prefix through the token fed to the
draft at its row, x[0..t+1], so two conversations that share x[0..t] and go on differently never
pair their draft rows at t.

Every row of a tensor ends up either in a pair to compare or with a reason it was not compared
(``results.Reason``): padding, prefix unknown, token conflict, outside the shared prefix, not
recorded on the other side, fed other (or unknown) tokens. Every copy of a row key is compared:
the k-th copy on one side pairs with the k-th on the other (the same prompt twice in a batch, or
in several epochs), and a side's extra copies with the other side's again.

Everything works on key-column arrays (no per-row Python objects): a token prefix is named by a
64-bit polynomial hash of its tokens, equal across traces, and rows are matched by sorting.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

import numpy as np

from tracediff.diff.pair import Pair
from tracediff.diff.results import Coverage, Reason, TokenMismatch
from tracediff.eagle3.names import DRAFT_INPUT_IDS, reads_fed_token
from tracediff.trace.reader import KeyColumns, RowKeys, Trace

FED = DRAFT_INPUT_IDS
PRIME = (1 << 31) - 1  # prefix hashes are taken modulo this prime, with two bases
BASES = (1_000_003, 1_234_567_891 % PRIME)
MIX_POSITION, MIX_DEPTH = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)

REASONS: tuple[str, ...] = typing.get_args(Reason)
CODE = {r: i for i, r in enumerate(REASONS)}
KEYED = -1  # a row with a known key (not yet paired or left out)


@dataclass
class Declared:
    """A trace's request token table (declared or learned by its recorder), with the trace's
    request codes."""

    code: np.ndarray
    position: np.ndarray
    token_id: np.ndarray
    names: dict[int, str] = field(default_factory=dict)

    @classmethod
    def none(cls) -> Declared:
        empty = np.zeros(0, np.int64)
        return cls(empty, empty, empty)

    @classmethod
    def fed(cls, keys: RowKeys | None, values: np.ndarray) -> Declared:
        """What ``draft.input_ids`` says of its requests' tokens: depth-0 row t was fed x[t + 1]."""
        if keys is None:
            return cls.none()
        at = (keys.depth == 0) & (keys.position >= 0)
        return cls(keys.request_code[at], keys.position[at] + 1, values[at])


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
    def of(cls, keys: list[KeyColumns], declared: Declared | None = None,
           fed: Declared | None = None) -> Prefixes:
        """From the request token table (it wins where they disagree: the row is then a token
        conflict), the depth-0 rows of every tensor of one trace (key columns only; padding rows,
        position -1, say nothing) and, where neither knows a position, the tokens ``fed`` to the
        draft (``Declared.fed``: a request's last draft row knows its next token)."""
        declared, fed = declared or Declared.none(), fed or Declared.none()
        parts = [(declared.code, declared.position, declared.token_id)]
        parts += [(k.request_code[s], k.position[s], k.token_id[s])
                  for k in keys for s in [(k.depth == 0) & (k.position >= 0)]]
        parts.append((fed.code, fed.position, fed.token_id))
        codes, positions, tokens = (np.concatenate(column).astype(np.int64) for column in zip(*parts))
        names = dict(declared.names)
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

    def sequence(self, request: str) -> np.ndarray:
        """The tokens of ``request`` at positions 0, 1, ... up to its first unknown position."""
        codes = [code for code, name in self.names.items() if name == request]
        if not codes:
            return np.zeros(0, np.int64)
        hit = np.isin(self.where // self.stride, codes)
        return self.tokens[hit].astype(np.int64)

    def lookup(self, codes: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, found, tokens) of the prefixes of these requests (by code) up to these positions;
        ``tokens`` is the request's token at the position."""
        inside = (codes >= 0) & (positions >= 0) & (positions < self.stride)
        at, found = _find_sorted(self.where, np.where(inside, codes * self.stride + positions, -1))
        found &= inside
        return (np.where(found, self.ids[at] if len(self.ids) else 0, 0).astype(np.uint64), found,
                np.where(found, self.tokens[at] if len(self.tokens) else 0, 0))


@dataclass
class Matched:
    """Row indices of one tensor name on both sides that correspond (in baseline row order), per
    side how many rows were left out, by reason, and the same per draft depth (``by_depth``)."""

    rows: Pair[np.ndarray]
    skipped: Pair[dict[str, int]]
    by_depth: list[Coverage] = field(default_factory=list)

    @classmethod
    def of(cls, keys: Pair[RowKeys], rows: Pair[np.ndarray], reasons: Pair[np.ndarray]) -> Matched:
        """From the pairs compared and each row's reason code (``KEYED`` where compared)."""
        return cls(rows, reasons.map(_counts), depth_coverage(keys, rows, reasons))


def depth_coverage(keys: Pair[RowKeys], rows: Pair[np.ndarray],
                   reasons: Pair[np.ndarray]) -> list[Coverage]:
    """One ``Coverage`` per draft depth either side holds rows at: rows, pairs and distinct rows
    compared there, and the rest by reason (one counting pass per side)."""
    depths = np.union1d(keys.a.depth, keys.b.depth).astype(np.int64)
    if not len(depths):
        return []
    span = int(depths.max()) + 1

    def per_depth(values: np.ndarray) -> np.ndarray:
        return np.bincount(values.astype(np.int64), minlength=span)

    held = keys.map(lambda k: per_depth(k.depth))
    compared = keys.zip(rows).starmap(lambda k, r: per_depth(k.depth[np.unique(r)]))
    aligned = per_depth(keys.a.depth[rows.a])

    def skipped(k: KeyColumns, reason: np.ndarray) -> np.ndarray:
        left = reason != KEYED
        cells = k.depth[left].astype(np.int64) * len(REASONS) + reason[left]
        return np.bincount(cells, minlength=span * len(REASONS)).reshape(span, len(REASONS))

    left = keys.zip(reasons).starmap(skipped)
    return [Coverage.of((int(held.a[d]), int(held.b[d])), int(aligned[d]),
                        (int(compared.a[d]), int(compared.b[d])), _named(left.a[d]), _named(left.b[d]),
                        depth=int(d)) for d in depths.tolist()]


def _named(counts: np.ndarray) -> dict[str, int]:
    """Reason counts by code as {reason: count}, zeros left out."""
    return {REASONS[c]: int(n) for c, n in enumerate(counts.tolist()) if n}


def key_of(ids: np.ndarray, positions: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """One uint64 per (prefix id, position, depth)."""
    with np.errstate(over="ignore"):
        return (ids.astype(np.uint64) ^ (positions.astype(np.uint64) * MIX_POSITION)
                ^ (depths.astype(np.uint64) * MIX_DEPTH))


@dataclass
class Keyed:
    """One side's rows of a tensor: each row's key and prefix id, and ``KEYED`` or the code of the
    reason it has no usable key."""

    key: np.ndarray
    prefix: np.ndarray
    entry: np.ndarray  # the row's (request, position) entry in the prefixes, where found
    reason: np.ndarray  # int8


def keyed_rows(rows: KeyColumns, prefixes: Prefixes, name: str | None = None) -> Keyed:
    """Each row's key: its prefix x[0..t] (x[0..t+1] for a draft row, ``fed_next``), position and
    depth. ``name``: the tensor's name as the baseline calls it (under ``--map``), else the rows'.
    A draft row whose next token no table knows is ``fed_unknown``."""
    ids, found, tokens = prefixes.lookup(rows.request_code, rows.position)
    where = rows.request_code * prefixes.stride + rows.position
    reason = np.full(len(rows), KEYED, np.int8)
    reason[~found] = CODE["prefix_unknown"]
    reason[found & (tokens != rows.token_id)] = CODE["token_conflict"]
    fed = fed_next(rows, name)
    if fed.any():
        next_ids, next_found, _ = prefixes.lookup(rows.request_code, rows.position + 1)
        ids = np.where(fed, next_ids, ids)
        where = np.where(fed & next_found, where + 1, where)
        reason[(reason == KEYED) & fed & ~next_found] = CODE["fed_unknown"]
    reason[rows.position < 0] = CODE["padding"]
    entry, _ = _find_sorted(prefixes.where, where)
    return Keyed(key_of(ids, rows.position, rows.depth), ids, entry, reason)


def prefix_ids(prefixes: Prefixes, codes: np.ndarray, positions: np.ndarray,
               fed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, found): the prefix id rows at these positions are keyed by (``key_of``): x[0..t], or
    x[0..t+1] where ``fed`` (``fed_next``)."""
    ids, found, _ = prefixes.lookup(codes, positions + fed.astype(np.int64))
    return ids, found


def fed_next(rows: KeyColumns, name: str | None = None) -> np.ndarray:
    """Per row: whether it depends on the token fed to the draft at its row (x[t + 1])."""
    return (rows.depth > 0) | reads_fed_token(name or rows.name)


def row_keys(rows: KeyColumns, prefixes: Prefixes, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(key, found) per row: ``key_of`` its prefix, position and depth."""
    keyed = keyed_rows(rows, prefixes, name)
    return keyed.key, keyed.reason == KEYED


@dataclass
class RowIndex:
    """The first row of each key of one side, sorted by key: finds rows by key."""

    keys: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, rows: KeyColumns, prefixes: Prefixes, name: str | None = None) -> RowIndex:
        keys, found = row_keys(rows, prefixes, name)
        first = _first_rows(keys, found)
        return cls(keys[first], first)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The row holding each key, or -1."""
        at, found = _find_sorted(self.keys, keys)
        return np.where(found, self.rows[at], -1) if len(self.rows) else np.full(len(keys), -1)


@dataclass
class Sides:
    """What aligning any tensor of two traces needs, worked out once per compare: each side's
    prefixes, fed draft tokens, and where its requests' tokens leave the other side's."""

    prefixes: Pair[Prefixes]
    fed: Pair[FedTokens]
    departed: Pair[np.ndarray]

    @classmethod
    def of(cls, prefixes: Pair[Prefixes], fed: Pair[FedTokens]) -> Sides:
        departed = Pair(departures(prefixes.a, prefixes.b), departures(prefixes.b, prefixes.a))
        return cls(prefixes, fed, departed)


def match(rows: Pair[RowKeys], sides: Sides, name: str | None = None) -> Matched:
    """Pair rows with equal (prefix, position, depth) and, at depth > 0, the same token fed at that
    depth (so the branches of a draft tree pair by what they were fed, not by their order); copies
    pair in order. Say why the rest are not compared."""
    prefixes, fed, departed = sides.prefixes, sides.fed, sides.departed
    keyed = rows.zip(prefixes).starmap(lambda r, p: keyed_rows(r, p, name or rows.a.name))
    reasons = keyed.map(lambda k: k.reason.copy())
    pair_keys = Pair(*(_with_fed_token(r, k, f, reason) for r, k, f, reason in
                       ((rows.a, keyed.a, fed.a, reasons.a), (rows.b, keyed.b, fed.b, reasons.b))))
    pairs = pair_copies(pair_keys, reasons.map(lambda r: r == KEYED))
    # where each side drafted, with known and with unknown fed tokens (before any row is classified)
    drafted = keyed.zip(reasons).starmap(lambda k, r: {"fed_differs": k.key[r == KEYED],
                                                       "fed_unknown": k.key[r == CODE["fed_unknown"]]})
    for mine, side, paired, reason, theirs, gone, own, other in (
            (keyed.a, rows.a, pairs.a, reasons.a, drafted.b, departed.a, prefixes.a, prefixes.b),
            (keyed.b, rows.b, pairs.b, reasons.b, drafted.a, departed.b, prefixes.b, prefixes.a)):
        deep = side.depth > 0
        left = reason == KEYED
        left[paired] = False
        for code, keys in theirs.items():  # the other side drafted here, fed other (unknown) tokens
            hit = left & deep & np.isin(mine.key, keys)
            reason[hit], left = CODE[code], left & ~hit
        # a chain row fed past the other side's text: no trace of that text can hold it
        past = left & deep
        past[past] = ~reaches(own, other, side.request_code[past], side.position[past] + 1 + side.depth[past])
        reason[past], left = CODE["past_other_text"], left & ~past
        outside = gone[mine.entry[left]] if len(gone) else np.zeros(int(left.sum()), bool)
        reason[left] = np.where(outside, CODE["outside_shared_prefix"], CODE["not_recorded"])
    feed = _feed_status(rows.a, pairs.a, prefixes.a, fed)
    reasons.a[pairs.a], reasons.b[pairs.b] = feed, feed
    same = feed == KEYED
    return Matched.of(rows, pairs.map(lambda p: p[same]), reasons)


def _with_fed_token(rows: RowKeys, keyed: Keyed, fed: FedTokens, reason: np.ndarray) -> np.ndarray:
    """Row keys to pair on: at depth > 0 the key also holds the token fed at the row's own depth
    (the k-th row of a key was fed what the k-th ``draft.input_ids`` row of that key holds); a
    depth > 0 row whose fed token is unknown gets ``fed_unknown`` in ``reason``."""
    deep = (rows.depth > 0) & (reason == KEYED)
    tokens, known = fed.at(keyed.key, _copy_numbers(keyed.key, reason == KEYED))
    reason[deep & ~known] = CODE["fed_unknown"]
    with np.errstate(over="ignore"):
        mixed = _scramble(keyed.key ^ _scramble(tokens.astype(np.uint64) + MIX_DEPTH))
    return np.where(deep, mixed, keyed.key)


def match_by_step(rows: Pair[RowKeys], prefixes: Pair[Prefixes], every: Pair[int]) -> Matched:
    """``--align step``: the i-th row of a step, position and depth on one side pairs with the i-th row
    of the same step, position and depth on the other (same producer, same batching: before vs after
    a change). A pair whose own tokens differ, or whose token prefixes are both known and differ,
    holds other text on each side: it is not compared (outside the shared prefix)."""
    keys = rows.map(lambda r: key_of(r.step, r.position, r.depth))
    usable = rows.map(lambda r: r.position >= 0)
    pairs = pair_copies(keys, usable)
    known = rows.zip(prefixes).starmap(lambda r, p: p.lookup(r.request_code, r.position)[:2])
    (id_a, in_a), (id_b, in_b) = known.a, known.b
    other_text = (in_a[pairs.a] & in_b[pairs.b] & (id_a[pairs.a] != id_b[pairs.b])) \
        | (rows.a.token_id[pairs.a] != rows.b.token_id[pairs.b])  # even where the prefix is unknown
    apart, pairs = pairs.map(lambda p: p[other_text]), pairs.map(lambda p: p[~other_text])
    reasons = usable.map(lambda u: np.where(u, KEYED, CODE["padding"]).astype(np.int8))
    for mine, paired, split, reason, their_every in ((rows.a, pairs.a, apart.a, reasons.a, every.b),
                                                     (rows.b, pairs.b, apart.b, reasons.b, every.a)):
        left = reason == KEYED
        left[paired] = False
        filtered = (their_every > 1) & (mine.step % max(their_every, 1) != 0)
        reason[left] = np.where(filtered[left], CODE["filtered_step"], CODE["not_recorded"])
        reason[np.setdiff1d(split, paired)] = CODE["outside_shared_prefix"]
    return Matched.of(rows, pairs, reasons)


def pair_copies(keys: Pair[np.ndarray], usable: Pair[np.ndarray]) -> Pair[np.ndarray]:
    """Row indices of pairs, in baseline row order: every usable row whose key the other side has is
    compared. The k-th copy of a key (in row order) on one side pairs with the k-th copy on the
    other; a side's extra copies pair with the other side's copies again, round robin (copy k with
    copy k mod n), so no copy goes unread."""
    groups = keys.zip(usable).starmap(_Groups.of)
    a_rows, b_rows = _partners(groups.a, groups.b, extra_only=False)
    b_more, a_more = _partners(groups.b, groups.a, extra_only=True)
    a_idx, b_idx = np.r_[a_rows, a_more].astype(np.int64), np.r_[b_rows, b_more].astype(np.int64)
    order = np.lexsort((b_idx, a_idx))
    return Pair(a_idx[order], b_idx[order])


@dataclass
class _Groups:
    """One side's usable rows grouped by key: rows sorted by (key, row), each key's first place and
    count, and each row's copy number within its key."""

    rows: np.ndarray
    keys: np.ndarray  # distinct, sorted
    start: np.ndarray
    count: np.ndarray
    group: np.ndarray  # per sorted row: its key's index in ``keys``
    rank: np.ndarray

    @classmethod
    def of(cls, keys: np.ndarray, usable: np.ndarray) -> _Groups:
        rows = np.flatnonzero(usable)
        rows = rows[np.lexsort((rows, keys[rows]))]
        k = keys[rows]
        start = _group_starts(k) if len(k) else np.zeros(0, np.int64)
        count = np.diff(np.r_[start, len(k)]).astype(np.int64)
        group = np.repeat(np.arange(len(start)), count)
        return cls(rows, k[start], start, count, group, np.arange(len(k)) - start[group])


def _partners(mine: _Groups, theirs: _Groups, extra_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """(my rows, their rows): each of my copies with their copy (my copy number mod their count);
    with ``extra_only``, only my copies beyond their count."""
    at, found = _find_sorted(theirs.keys, mine.keys[mine.group])
    count = np.where(found, theirs.count[at] if len(theirs.count) else 1, 1)
    take = found & (mine.rank >= count) if extra_only else found
    return mine.rows[take], theirs.rows[theirs.start[at[take]] + mine.rank[take] % count[take]]


def _counts(reason: np.ndarray) -> dict[str, int]:
    """Rows left out (not ``KEYED``) by reason."""
    return _named(np.bincount(reason[reason != KEYED].astype(np.int64), minlength=len(REASONS)))


@dataclass
class FedTokens:
    """The token fed to the draft (``draft.input_ids``) per (row key, copy number): one producer logs
    the branches of a draft tree in the same order for every tensor, so the k-th row of a key in any
    draft tensor was fed what the k-th ``draft.input_ids`` row of that key holds."""

    copies: np.ndarray  # sorted ``_copy_key`` of each draft.input_ids row
    values: np.ndarray  # the token, in the same order

    def at(self, keys: np.ndarray, copy: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, found) at these row keys and copy numbers (the first copy by default)."""
        wanted = _copy_key(keys, np.zeros(len(keys), np.int64) if copy is None else copy)
        at, found = _find_sorted(self.copies, wanted)
        found &= (copy is None) or (copy >= 0)
        if not len(self.values):
            return np.zeros(len(keys), np.int64), found
        return np.where(found, self.values[at], 0), found


def fed_values(trace: Trace, keys: RowKeys | None) -> np.ndarray:
    """The token of each ``draft.input_ids`` row (its first element), int64."""
    if keys is None:
        return np.zeros(0, np.int64)
    return trace.gather(keys).reshape(len(keys), -1)[:, 0].astype(np.int64)


def fed_tokens(keys: RowKeys | None, values: np.ndarray, prefixes: Prefixes) -> FedTokens:
    """``FedTokens`` of one side from its ``draft.input_ids`` rows and their ``fed_values``."""
    if keys is None:
        return FedTokens(np.zeros(0, np.uint64), np.zeros(0, np.int64))
    keyed = keyed_rows(keys, prefixes, FED)
    usable = keyed.reason == KEYED
    copies = _copy_key(keyed.key, _copy_numbers(keyed.key, usable))[usable]
    order = np.argsort(copies, kind="stable")
    return FedTokens(copies[order], values[usable][order])


def _copy_numbers(keys: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Per row: how many usable rows before it hold the same key (-1 for unusable rows)."""
    groups = _Groups.of(keys, usable)
    out = np.full(len(keys), -1, np.int64)
    out[groups.rows] = groups.rank
    return out


def _copy_key(keys: np.ndarray, copy: np.ndarray) -> np.ndarray:
    """One uint64 per (row key, copy number), not symmetric in the two."""
    with np.errstate(over="ignore"):
        return _scramble(keys) + copy.astype(np.uint64)


def reaches(mine: Prefixes, other: Prefixes, codes: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Whether ``other`` holds the text of ``mine``'s requests (by code) up to ``positions``: it
    knows the prefix of the last of these positions ``mine`` knows, and some request of ``other``
    with that prefix goes on at least to the position (past what ``mine`` knows, with tokens
    ``mine`` cannot check)."""
    if not len(other.ids):
        return np.zeros(len(codes), bool)
    upto = np.minimum(positions, _last_positions(mine, codes))
    ids, found, _ = mine.lookup(codes, upto)
    lasts = _last_positions(other, other.where // other.stride)  # per entry: how far its request goes
    order = np.argsort(other.ids, kind="stable")
    ids_sorted = other.ids[order]
    starts = np.flatnonzero(np.r_[True, ids_sorted[1:] != ids_sorted[:-1]])
    furthest = np.maximum.reduceat(lasts[order], starts)  # per distinct prefix, over its requests
    at, known = _find_sorted(ids_sorted[starts], ids)
    return found & known & (furthest[at] >= positions)


def _last_positions(prefixes: Prefixes, codes: np.ndarray) -> np.ndarray:
    """The last position each request (by code) knows without a gap; -1 for a request it lacks."""
    if not len(prefixes.where):
        return np.full(len(codes), -1, np.int64)
    end = np.maximum(np.searchsorted(prefixes.where, (codes + 1) * prefixes.stride) - 1, 0)
    same = prefixes.where[end] // prefixes.stride == codes
    return np.where(same, prefixes.where[end] % prefixes.stride, -1)


def departures(mine: Prefixes, other: Prefixes) -> np.ndarray:
    """Per (request, position) entry of ``mine``: whether the request's tokens have left every
    request of ``other`` at or before this position (``other`` continued the same tokens with a
    different one). A request ``other`` merely knows less of (it stopped, or has a gap) has not
    left it: rows there are not recorded on the other side, not outside the shared prefix."""
    known = np.isin(mine.ids, other.ids)
    _, continued = _find_sorted(np.sort(_parents(other)), _parents(mine))
    leaves = (~known & continued).astype(np.int64)
    if not len(leaves):
        return np.zeros(0, bool)
    start = _group_starts(mine.where // mine.stride)
    so_far = np.cumsum(leaves)
    before = np.repeat(so_far[start] - leaves[start], np.diff(np.r_[start, len(leaves)]))
    return so_far - before > 0


def first_token_difference(prefixes: Pair[Prefixes], request_b: str | None = None) -> TokenMismatch | None:
    """Where a target request's tokens first leave every baseline request (a different chat
    template, say): the request (``request_b`` if given), the position and both tokens there, and
    how many target requests leave somewhere. None when every target request is a prefix of, or
    extends, some baseline request."""
    a, b = prefixes.a, prefixes.b
    known = np.isin(b.ids, a.ids)
    # a's token after each of its prefixes: parent id (0 for the empty prefix) -> next token
    parent_a = _parents(a)
    order = np.argsort(parent_a, kind="stable")
    at, found = _find_sorted(parent_a[order], _parents(b))
    position_b = b.where % b.stride
    previous_known = np.r_[False, known[:-1]] & (position_b > 0)
    leaves = np.flatnonzero(~known & found & ((position_b == 0) | previous_known))
    codes = b.where[leaves] // b.stride
    mine_only = leaves if request_b is None else leaves[[b.names.get(int(c)) == request_b for c in codes]]
    if not len(mine_only):
        return None
    i = int(mine_only[0])
    mine = int(order[at[i]])  # the baseline entry with the same parent
    return TokenMismatch(request_a=a.names[int(a.where[mine] // a.stride)],
                         request_b=b.names[int(b.where[i] // b.stride)], position=int(position_b[i]),
                         token_a=int(a.tokens[mine]), token_b=int(b.tokens[i]),
                         requests_differing=len(np.unique(codes)))


def _feed_status(rows: RowKeys, picked: np.ndarray, prefixes: Prefixes, fed: Pair[FedTokens]) -> np.ndarray:
    """For picked rows at depth d: ``KEYED`` where every depth 1..d-1 of the row's chain was fed the
    same token on both sides (the first branch's, for trees), else the code of ``fed_differs`` or
    ``fed_unknown`` (a side did not record what it fed)."""
    depth = rows.depth[picked]
    differs, unknown = np.zeros(len(picked), bool), np.zeros(len(picked), bool)
    ids, _, _ = prefixes.lookup(rows.request_code[picked], rows.position[picked] + 1)  # the chain's root
    for d in range(1, int(depth.max(initial=0))):  # a row's own depth was matched when pairing
        deep = depth > d
        keys = key_of(ids[deep], rows.position[picked][deep], np.full(int(deep.sum()), d))
        (tok_a, in_a), (tok_b, in_b) = fed.a.at(keys), fed.b.at(keys)
        differs[deep] |= in_a & in_b & (tok_a != tok_b)
        unknown[deep] |= ~(in_a & in_b)
    status = np.full(len(picked), KEYED, np.int8)
    status[unknown] = CODE["fed_unknown"]
    status[differs] = CODE["fed_differs"]
    return status


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
    """The id of each request's prefix x[0..p]: two polynomial hashes modulo the prime 2**31 - 1 with
    independent bases and symbols (``_symbols``), joined into 62 bits and scrambled. Each is
    h(p) = sum over i <= p of s(token_i) * B**(p - i) mod P, computed per request as
    B**p * cumsum(s(token_i) * B**-i): every product of two residues fits int64, and a cumsum of
    residues does too (fewer than 2**32 entries). A prime modulus matters: hashes modulo 2**64
    collide for any odd base on Thue-Morse strings, so two different texts could align. The exact
    symbol keeps two vocab ids from ever hashing alike (a scrambled residue alone maps some pairs of
    a 128k vocab to one value); the scrambled one spreads structured strings."""
    if not len(code):
        return np.zeros(0, np.uint64)
    top = int(position.max()) + 1
    start = _group_starts(code)
    lengths = np.diff(np.r_[start, len(code)])
    parts = []
    for base, symbol in zip(BASES, _symbols(token)):
        terms = symbol * _powers(pow(base, PRIME - 2, PRIME), top)[position] % PRIME
        running = np.cumsum(terms)
        within = (running - np.repeat(running[start] - terms[start], lengths)) % PRIME
        parts.append((within * _powers(base, top)[position] % PRIME).astype(np.uint64))
    return _scramble((parts[0] << np.uint64(32)) | parts[1])


def _symbols(token: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token as a residue for each hash: token + 1 (one-to-one for every id below 2**31 - 2,
    so two tokens never look alike), and a scrambled residue (so structured strings spread)."""
    exact = (token.astype(np.int64) % PRIME + 1) % PRIME
    return exact, (_scramble(token.astype(np.uint64)) % np.uint64(PRIME)).astype(np.int64)


def _powers(base: int, n: int) -> np.ndarray:
    """base**i mod PRIME for i < n (int64), by doubling: log2(n) vector steps."""
    out = np.ones(max(n, 1), np.int64)
    k = 1
    while k < n:
        m = min(k, n - k)
        out[k : k + m] = out[:m] * pow(base, k, PRIME) % PRIME
        k += m
    return out


def _scramble(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 that spreads every input bit."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _parents(prefixes: Prefixes) -> np.ndarray:
    """The id of x[0..p-1] for each entry (0 at position 0)."""
    position = prefixes.where % prefixes.stride
    parent = np.zeros(len(prefixes.ids), np.uint64)
    inner = np.flatnonzero(position > 0)
    parent[inner] = prefixes.ids[inner - 1]  # sorted by (request, position), no gaps: the entry before
    return parent
