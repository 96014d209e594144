"""Whether the two sides were fed other text where both recorded it: a request of one side is a
request of the other with a small edit (a token replaced, added or left out, the texts agreeing
again right after it), as an extra BOS or another chat template makes. Numpy over the prefixes.

Two requests that share a system prompt and then go on differently are not an edit: they are two
texts, and the rows past the shared prefix are simply not comparable (coverage says so). An edit
needs the texts to agree again within ``REACH`` tokens of where they part, over ``AGAIN`` tokens
(or to the end of the shorter text, at least ``AT_END`` tokens): a different user message or a
different answer does not do that, a template's extra token does. So a verdict built on an edit
accuses only text that is the same text but for the edit.

The search, for every request of b that leaves every request of a at position p
(``align.departures``), all at once: where the texts agree again, b's window at s and a's at q
(both within ``REACH`` of p, so the edit spans ``s - e`` tokens of b and ``q - e`` of a after the
``e`` tokens they share), is looked up by hash among a's windows that start near some request's p;
a hit is a partner when its text shares exactly ``e`` tokens with b (prefix ids, which both sides
compute alike) and agrees with b token by token after the edit, so a hash collision never makes an
edit. Unrelated traffic (many conversations after one system prompt) costs a few vector passes over
the requests' tokens near where they part, and a handful of hash hits to check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.align import Prefixes, departures
from tracediff.diff.pair import Pair
from tracediff.diff.results import TextEdit

REACH = 4  # the most tokens an edit spans on either side, and how far before the leave it may start
AGAIN = 6  # tokens that must agree again after the edit
AT_END = 2  # ... or this many at least, where a text ends sooner (fewer where both end)


@dataclass(frozen=True)
class Side:
    """One side's known tokens, a request after another (``Prefixes``' order): where each request
    starts in the flat arrays and how long it is."""

    prefixes: Prefixes
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, prefixes: Prefixes) -> Side:
        code = prefixes.where // prefixes.stride
        starts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]]) if len(code) else np.zeros(0, np.int64)
        return cls(prefixes, starts, np.diff(np.r_[starts, len(code)]))

    def tokens(self, i: int) -> np.ndarray:
        return self.prefixes.tokens[self.starts[i]: self.starts[i] + self.lengths[i]]

    def ids(self, i: int) -> np.ndarray:
        return self.prefixes.ids[self.starts[i]: self.starts[i] + self.lengths[i]]

    def name(self, i: int) -> str:
        return self.prefixes.names[int(self.prefixes.where[self.starts[i]] // self.prefixes.stride)]


@dataclass(frozen=True)
class Windows:
    """a's windows of 1 to ``AGAIN`` tokens that start at the positions wanted, hashed with their
    length and start (a window that ends its request's text once more as a tail, ``tail_hash``):
    sorted hashes and each window's request (index into ``Side``)."""

    hashes: np.ndarray
    request: np.ndarray

    @classmethod
    def of(cls, side: Side, wanted: np.ndarray) -> Windows:
        """``wanted``: per position, whether some window starting there may be looked up."""
        tokens = side.prefixes.tokens.astype(np.int64)
        request = np.repeat(np.arange(len(side.starts)), side.lengths)
        start = np.arange(len(tokens)) - np.repeat(side.starts, side.lengths)
        left = np.repeat(side.lengths, side.lengths) - start  # tokens from here to the request's end
        near = np.flatnonzero(wanted[np.minimum(start, len(wanted) - 1)] & (start < len(wanted)))
        parts = []
        for n in range(1, AGAIN + 1):
            at = near[left[near] >= n]
            h = window_hash([tokens[at + k] for k in range(n)], start[at])
            tails = left[at] == n  # a tail is also filed under its own hash, for agreements to a's end
            parts += [(h, at), (tail_hash(h[tails]), at[tails])]
        hashes = np.concatenate([h for h, _ in parts])
        order = np.argsort(hashes, kind="stable")
        return cls(hashes[order], request[np.concatenate([i for _, i in parts])][order])

    def find(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) per hash: the range of windows holding it."""
        return np.searchsorted(self.hashes, hashes, "left"), np.searchsorted(self.hashes, hashes, "right")


def window_hash(columns: list[np.ndarray], start: np.ndarray) -> np.ndarray:
    """A 64-bit hash per window of tokens (given column by column) joined with its length and start
    (collisions are checked after, token by token)."""
    with np.errstate(over="ignore"):
        h = start.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(len(columns))
        for column in columns:
            h = (h ^ column.astype(np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(29)
        return h


def tail_hash(hashes: np.ndarray) -> np.ndarray:
    """The hash a window that ends its text is filed under once more."""
    with np.errstate(over="ignore"):
        return (hashes ^ np.uint64(0x5851F42D4C957F2D)) * np.uint64(0x94D049BB133111EB)


# where the texts may agree again, relative to where b leaves a: (b's offset, a's offset)
SHIFTS = np.array([(s, q) for s in range(-REACH, REACH + 1) for q in range(-REACH, REACH + 1)
                   if abs(s - q) <= REACH and max(s, q) > -REACH], np.int64)


def text_edit(prefixes: Pair[Prefixes], departed: Pair[np.ndarray] | None = None) -> TextEdit | None:
    """The first request of b whose text is a request of a's with a small edit (module docstring),
    with how many requests of b hold one, and whether every request of b (two or more) holds this
    very edit at this very position; None when no request does. The search runs both ways (a
    request of b that shares more with another request of a than with its partner is found from the
    partner's side), so the same pair gives the same edits in either order. ``departed``: each
    side's ``departures`` against the other, where the caller has them."""
    sides = Pair(Side.of(prefixes.a), Side.of(prefixes.b))
    gone = departed if departed is not None else \
        Pair(departures(prefixes.a, prefixes.b), departures(prefixes.b, prefixes.a))
    found = {e.request_b: e for e in _search(sides.b, sides.a, gone.a)}  # a's requests, seen from b
    found = {e.request_a: TextEdit(e.request_b, e.request_a, e.position, e.token_b, e.token_a, e.tokens_b,
                                   e.tokens_a, requests=1, every_request=False) for e in found.values()}
    found.update({e.request_b: e for e in _search(sides.a, sides.b, gone.b)})
    if not found:
        return None
    order = [sides.b.name(i) for i in range(len(sides.b.starts))]
    edits = [found[name] for name in order if name in found]
    first = edits[0]
    what = (first.position, first.tokens_a, first.tokens_b)
    same = len(edits) == len(order) > 1 and all((e.position, e.tokens_a, e.tokens_b) == what for e in edits)
    return TextEdit(first.request_a, first.request_b, first.position, first.token_a, first.token_b,
                    first.tokens_a, first.tokens_b, requests=len(edits), every_request=same)


def _search(a: Side, b: Side, gone: np.ndarray) -> list[TextEdit]:
    """The edits of b's requests that leave a (``gone``: b's ``departures`` against a)."""
    if not len(a.starts) or not gone.any():
        return []
    at = np.minimum.reduceat(np.where(gone, np.arange(len(gone)), len(gone)), b.starts)  # first leave
    leaving = np.flatnonzero(at < b.starts + b.lengths)
    leave = at[leaving] - b.starts[leaving]  # per leaving request, the position it leaves a at
    wanted = np.zeros(int(leave.max()) + REACH + 1, bool)
    for shift in range(-REACH, REACH + 1):
        wanted[np.clip(leave + shift, 0, None)] = True
    found = _edits(a, b, leaving, leave, Windows.of(a, wanted))
    for r, edit in _ends(a, b, leaving, leave).items():
        found.setdefault(r, edit)
    return [found[r] for r in sorted(found)]


def _edits(a: Side, b: Side, leaving: np.ndarray, leave: np.ndarray, windows: Windows) -> dict[int, TextEdit]:
    """Per leaving request of b its smallest edit against some request of a after which the texts
    agree again, where it has one. Every (request, shift, agreement length) is hashed in one pass;
    only hash hits are checked."""
    request = np.repeat(leaving, len(SHIFTS))
    s = np.repeat(leave, len(SHIFTS)) + np.tile(SHIFTS[:, 0], len(leaving))
    q = np.repeat(leave, len(SHIFTS)) + np.tile(SHIFTS[:, 1], len(leaving))
    rest = b.lengths[request] - s  # b's tokens from s on
    ok = (s >= 0) & (q >= 0) & (rest >= 1)
    request, s, q, rest = request[ok], s[ok], q[ok], rest[ok]
    tokens = b.prefixes.tokens.astype(np.int64)
    starts = b.starts[request]
    past = leave[np.searchsorted(leaving, request)]  # a window must reach past where b leaves a
    full = np.minimum(rest, AGAIN)
    hits = []  # (request, s, q, window length, lo, hi)
    for n in range(1, AGAIN + 1):
        # n tokens agree: all of b's rest (up to AGAIN); fewer (at least AT_END) where a's text ends
        # there; fewer than AT_END only where both texts end there
        pick = np.flatnonzero((full >= n) & (s + n > past) & ((n >= AT_END) | (full == n)))
        h = window_hash([tokens[starts[pick] + s[pick] + k] for k in range(n)], q[pick])
        h = np.where((full[pick] > n) | (n < AT_END), tail_hash(h), h)
        first, last = windows.find(h)
        hits += [(int(request[i]), int(s[i]), int(q[i]), n, int(first[k]), int(last[k]))
                 for k, i in zip(np.flatnonzero(last > first).tolist(), pick[last > first].tolist())]
    best: dict[int, tuple[tuple[int, int, int], TextEdit]] = {}
    for r, si, qi, n, lo, hi in hits:
        text, ids = b.tokens(r), b.ids(r)
        window = text[si: si + n]
        if n >= AT_END and len(set(window.tolist())) < 2:
            continue  # one token repeated (a generation loop) is no evidence of one text
        for w in range(lo, hi):
            partner = int(windows.request[w])
            own = a.tokens(partner)
            if not (own[qi: qi + n] == window).all():
                continue  # a hash collision
            edit = _edit_at(b, r, a, partner, si, qi, int(leave[np.searchsorted(leaving, r)]), ids, own)
            if edit is not None:
                rank = (si - edit.position + qi - edit.position, abs(si - qi), -edit.position)
                if r not in best or rank < best[r][0]:
                    best[r] = (rank, edit)
    return {r: edit for r, (_, edit) in best.items()}


def _ends(a: Side, b: Side, leaving: np.ndarray, leave: np.ndarray) -> dict[int, TextEdit]:
    """Requests of b whose last token alone differs from a request of a's of the same length (the
    last token replaced: nothing can agree after it). More than one token apart at the end is two
    endings, not an edit: nothing says the texts are one. Found by the prefix id before the end."""
    last = np.flatnonzero(leave == b.lengths[leaving] - 1)
    if not len(last):
        return {}
    ends: dict[int, list[int]] = {}  # id of the prefix before a request's last token -> requests
    for i in np.flatnonzero(a.lengths >= 1).tolist():
        ids = a.ids(i)
        ends.setdefault(int(ids[-2]) if len(ids) > 1 else 0, []).append(i)
    found: dict[int, TextEdit] = {}
    for r in leaving[last].tolist():
        text, ids = b.tokens(r), b.ids(r)
        e = len(text) - 1
        same_start = ends.get(int(ids[e - 1]) if e else 0, [])
        partner = next((i for i in same_start if a.lengths[i] == len(text)), None)
        if partner is not None:
            own = int(a.tokens(partner)[e])
            found[r] = TextEdit(a.name(partner), b.name(r), e, own, int(text[e]), [own], [int(text[e])],
                                requests=1, every_request=False)
    return found


def _edit_at(b: Side, r: int, a: Side, partner: int, s: int, q: int, leave: int, ids: np.ndarray,
             own: np.ndarray) -> TextEdit | None:
    """The edit that makes request ``r`` of b agree with ``partner`` of a from s (b) and q (a) on:
    they must share exactly e tokens, e within ``REACH`` of both and of where b leaves a."""
    text = b.tokens(r)
    own_ids = a.ids(partner)
    for e in range(min(s, q, leave), max(s, q, leave) - REACH - 1, -1):
        if e < 0 or s - e + q - e == 0 or len(own) <= e:
            continue
        if own[e] == text[e] or (e and own_ids[e - 1] != ids[e - 1]):
            continue  # the texts must agree before e and part at e
        return TextEdit(a.name(partner), b.name(r), e, int(own[e]), int(text[e]), own[e: q].tolist(),
                        text[e: s].tolist(), requests=1, every_request=False)
    return None
