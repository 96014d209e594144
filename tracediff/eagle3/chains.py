"""Which rows a trace's server drafted chains from, and how a verify scores a chain: numpy only,
so compare reads a trace's own acceptance without torch. ``drafted_from``: the anchors; ``leading_hits``:
what a verify accepts of each chain with every depth's target token recorded; ``tree_shape``: no chain."""

from __future__ import annotations

import numpy as np

from tracediff.eagle3.names import DRAFT_TOKEN_TARGET, VERIFY_ACCEPT_LEN
from tracediff.trace.reader import Trace


def drafted_from(trace: Trace) -> dict[str, set[int]]:
    """Per request, the positions the server drafted a chain from, on a serving trace (its contract
    holds the server's ``speculative_args``): where it holds draft rows at depth 1 (the last row of
    each forward: the prefill's last token, then each decode step); a server of one step drafts no
    depth 1, and there its chains are its verifies (``verify.accept_len`` rows), else its
    ``draft.token_target`` rows (the tokens draft_forward returned). Empty for any other trace, or
    one that records no chain."""
    found: dict[str, set[int]] = {}
    if trace.speculative_args is None:
        return found
    names = [n for n in trace.names() if n.startswith("draft.")
             and (trace.index.depth[trace.select(name=n)] == 1).any()]
    depth = 1
    if not names and trace.speculative_args.get("num_steps") == 1:
        # a one-step server's chains are its verifies (verify.accept_len rows, at each anchor), else
        # the tokens draft_forward returned (draft.token_target: SGLang records them at the anchors)
        recorded: list[str] = [n for n in (VERIFY_ACCEPT_LEN, DRAFT_TOKEN_TARGET) if n in trace.names()]
        names, depth = recorded[:1], 0
    for name in names:
        try:
            keys = trace.keys(name, depth=depth)
        except KeyError:  # static records only
            continue
        for request, position in zip(keys.request.tolist(), keys.position.tolist()):
            found.setdefault(request, set()).add(int(position))
    return found


UNSCORED = "some depth has no recorded target token"  # why a chain is unscored, as the reports say it


def leading_hits(hits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per chain (row): how many leading depths the draft got right (what a verify accepts of it),
    or -1 where the chain is unscored: some depth of it has no recorded target token (it reaches
    past the recorded text). The one scoring rule of replay, explain and compare's acceptance.
    Scoring a chain whose first miss falls inside the text while leaving out one accepted up to
    the text's end would keep chains by their outcome, and bias the figure toward short chains."""
    depths = hits.shape[1]
    lead = np.where(hits.all(axis=1), depths, np.argmin(hits, axis=1))
    return np.where(valid.all(axis=1), lead, -1)


def tree_shape(trace: Trace) -> str | None:
    """Why the server's verify did not score chains, where it drafted trees (topk > 1), else None."""
    spec = trace.speculative_args or {}
    topk = spec.get("topk")
    if isinstance(topk, int) and not isinstance(topk, bool) and topk > 1:
        tokens = spec.get("num_draft_tokens")
        return (f"the server drafted trees (topk {topk}" + (f", {tokens} draft tokens" if tokens else "")
                + "): a verify accepts a tree's best path, which replay does not score; the figure is the "
                "teacher-forced chain from every row")
    return None
