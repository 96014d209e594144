"""Row alignment by content: two rows correspond when their requests hold the same tokens from
position 0 up to the row's position, at the same position and draft depth; producer request ids,
steps and batching do not matter. A draft row at depth d > 0 is comparable only where both sides
fed the draft the same tokens at depths 1..d.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.pair import Pair
from tracediff.trace.reader import RowKeys, Trace

FED = "draft.input_ids"


@dataclass
class Prefixes:
    """Per (request, position): an id of the token prefix x[0..position], equal across traces."""

    ids: dict[tuple[str, int], int]
    tokens: dict[str, dict[int, int]]  # request -> position -> token

    @classmethod
    def of(cls, keys: list[RowKeys]) -> Prefixes:
        """From the depth-0 rows of every tensor of one trace (key columns only)."""
        tokens: dict[str, dict[int, int]] = {}
        for k in keys:
            shallow = k.depth == 0
            for r, p, t in zip(k.request[shallow].tolist(), k.position[shallow].tolist(),
                               k.token_id[shallow].tolist()):
                tokens.setdefault(r, {}).setdefault(p, t)
        ids: dict[tuple[str, int], int] = {}
        for request, by_position in tokens.items():
            running = 0
            for position in range(max(by_position) + 1):
                if position not in by_position:
                    break  # a gap: later prefixes are unknown
                running = hash((running, by_position[position]))
                ids[(request, position)] = running
        return cls(ids=ids, tokens=tokens)


@dataclass
class Matched:
    """Row indices of one tensor name on both sides that correspond, in baseline row order."""

    rows: Pair[np.ndarray]
    not_comparable: int  # depth > 0 rows whose fed tokens differ between the sides


def row_keys(rows: RowKeys, prefixes: Prefixes) -> list[tuple | None]:
    return [None if (r, int(p)) not in prefixes.ids else (prefixes.ids[(r, int(p))], int(p), int(d))
            for r, p, d in zip(rows.request.tolist(), rows.position, rows.depth)]


def match(rows: Pair[RowKeys], prefixes: Pair[Prefixes], fed: Pair[dict] | None = None) -> Matched:
    """Pair up rows with equal (prefix, position, depth); the first occurrence on each side wins."""
    keys = Pair(row_keys(rows.a, prefixes.a), row_keys(rows.b, prefixes.b))
    where_b: dict[tuple, int] = {}
    for j, key in enumerate(keys.b):
        if key is not None:
            where_b.setdefault(key, j)
    seen: set[tuple] = set()
    a_idx, b_idx, skipped = [], [], 0
    for i, key in enumerate(keys.a):
        if key is None or key in seen or key not in where_b:
            continue
        seen.add(key)
        if key[2] > 0 and fed is not None and not _same_feed(key, fed):
            skipped += 1
            continue
        a_idx.append(i)
        b_idx.append(where_b[key])
    return Matched(rows=Pair(np.array(a_idx, dtype=np.int64), np.array(b_idx, dtype=np.int64)),
                   not_comparable=skipped)


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


def fed_tokens(trace: Trace, keys: RowKeys | None, prefixes: Prefixes) -> dict[tuple, int]:
    """(prefix id, position, depth) -> the token fed to the draft there (``draft.input_ids``)."""
    if keys is None:
        return {}
    values = trace.gather(keys).reshape(-1).tolist()
    return {key: int(v) for key, v in zip(row_keys(keys, prefixes), values) if key is not None}


def _same_feed(key: tuple, fed: Pair[dict]) -> bool:
    prefix, position, depth = key
    for d in range(1, depth + 1):
        k = (prefix, position, d)
        if k not in fed.a or k not in fed.b or fed.a[k] != fed.b[k]:
            return False
    return True


def first_token_difference(prefixes: Pair[Prefixes]) -> dict | None:
    """Where a target request's tokens first leave every baseline request (a different chat
    template, say): the request, the position and both tokens there. None when every target
    request is a prefix of, or extends, some baseline request. One pass over the tokens: a prefix
    is shared exactly when its id is among the baseline's."""
    known = set(prefixes.a.ids.values())
    next_token: dict[int, int] = {}  # baseline prefix id of x[0..p-1] (0: empty) -> a token x[p]
    for request, by_position in prefixes.a.tokens.items():
        for position, token in by_position.items():
            parent = 0 if position == 0 else prefixes.a.ids.get((request, position - 1))
            if parent is not None:
                next_token.setdefault(parent, token)
    for request, by_position in prefixes.b.tokens.items():
        parent = 0
        for position in sorted(by_position):
            prefix = prefixes.b.ids.get((request, position))
            if prefix is None:
                break
            if prefix not in known:
                if parent in next_token:
                    return {"request_b": request, "position": position, "a": next_token[parent],
                            "b": by_position[position]}
                break  # b goes on where the baseline ended: no difference
            parent = prefix
    return None
