"""The report's view of what each side was fed: one request's tokens on both sides around where
they first differ, or around the first divergence when they agree."""

from __future__ import annotations

import numpy as np

from tracediff.diff.align import Prefixes
from tracediff.diff.pair import Pair
from tracediff.diff.results import RowRef, TextEdit, TokenMismatch, TokenView

MAX_TOKENS = 128  # tokens shown per side


def token_view(prefixes: Pair[Prefixes], mismatch: TextEdit | TokenMismatch | None,
                first: RowRef | None) -> TokenView | None:
    """The tokens of the request pair that a text edit or token mismatch names, else of the first
    divergence's row; None when the report names neither (or the first divergence is a static tensor)."""
    if mismatch is not None:
        requests = Pair(mismatch.request_a, mismatch.request_b)
    elif first is not None and first.position >= 0:  # a static tensor's row has no tokens
        requests = Pair(first.request_a, first.request_b)
    else:
        return None
    tokens = prefixes.zip(requests).starmap(Prefixes.sequence)
    shared = min(len(tokens.a), len(tokens.b))
    differs = np.flatnonzero(tokens.a[:shared] != tokens.b[:shared])
    difference = int(differs[0]) if len(differs) else None
    focus = None if first is None else first.position
    center = next((p for p in (difference, focus) if p is not None), 0)
    start = max(0, min(center - MAX_TOKENS // 2, max(len(tokens.a), len(tokens.b)) - MAX_TOKENS))
    shown = tokens.map(lambda t: t[start : start + MAX_TOKENS].tolist())
    return TokenView(request_a=requests.a, request_b=requests.b, start=start, tokens_a=shown.a,
                     tokens_b=shown.b, first_difference=difference, focus=focus)
