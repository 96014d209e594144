"""What a trace's own recorded drafts would have been accepted: per depth, the share of recorded
draft tokens (target ids) equal to the target's token there, and the expected accept length of its
chains (the server's, on a serving trace; every row's, else). Numpy only: compare reads it.

A chain is scored when every depth of it has a recorded target token (``chains.leading_hits``);
the others (a chain reaching past the recorded text) are counted, unscored.

The drafted target ids are ``draft.token_target`` where recorded, else ``draft.token`` mapped by
the recorded ``draft.d2t`` (offsets); the target's tokens are ``target.token`` (row p: the token
after position p). A row at position t and depth d drafted the token after t+1+d (its anchor's
position on a serving chain). No figure where either is missing, or no row can be scored."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracediff.eagle3.chains import drafted_from, leading_hits, tree_shape
from tracediff.eagle3.names import DRAFT_D2T, DRAFT_TOKEN, DRAFT_TOKEN_TARGET, TARGET_TOKEN, VERIFY_ACCEPT_LEN
from tracediff.trace.reader import Trace


@dataclass
class Acceptance:
    """A side's recorded drafts scored against its recorded target tokens."""

    depth_accuracy: list[float]  # per depth, over ``depth_rows`` (NaN where none)
    depth_rows: list[int]
    expected_accept_len: float  # 1 + the mean leading hits of the scored chains (NaN: none scored)
    chains: int  # scored: every depth has a recorded target token
    scored_on: str  # "the server's chains" or "every row"
    chains_unscored: int  # the others: some depth has no recorded target token (past the text's end)
    # the server's own verifies, where it recorded every outcome (``verify.accept_len``): 1 + accepted /
    # verifies, the figure its own counters give (vLLM's /metrics); it also counts the verifies of
    # chains reaching past the text, which the figure above cannot score
    server_verifies: int = 0
    server_accept_len: float | None = None


def recorded_acceptance(trace: Trace) -> Acceptance | None:
    """The trace's own acceptance estimate, or None (see the module docstring)."""
    names = set(trace.names())
    if TARGET_TOKEN not in names or not ({DRAFT_TOKEN_TARGET, DRAFT_TOKEN} & names):
        return None
    if DRAFT_TOKEN_TARGET in names:
        drafted = trace.rows(DRAFT_TOKEN_TARGET)
        ids = drafted.numpy().astype(np.int64)
    else:
        drafted = trace.rows(DRAFT_TOKEN)
        table = trace.last_static(DRAFT_D2T)
        if table is None:
            return None
        d2t = np.asarray(table.data, dtype=np.int64)
        ids = drafted.numpy().astype(np.int64)
        ids = ids + d2t[np.clip(ids, 0, len(d2t) - 1)]
    targets = trace.rows(TARGET_TOKEN, depth=0)
    label = {(r, int(p)): int(v) for r, p, v in zip(targets.request.tolist(), targets.position.tolist(),
                                                    targets.numpy().tolist())}
    anchors = drafted_from(trace) if tree_shape(trace) is None else {}
    depths = int(drafted.depth.max()) + 1 if len(drafted) else 0
    hits: dict[tuple[str, int], np.ndarray] = {}
    valid: dict[tuple[str, int], np.ndarray] = {}
    for r, p, d, v in zip(drafted.request.tolist(), drafted.position.tolist(), drafted.depth.tolist(),
                          ids.tolist()):
        if p < 0 or (anchors and p not in anchors.get(r, ())):
            continue
        key = (r, int(p))
        want = label.get((r, int(p) + 1 + int(d)))
        hits.setdefault(key, np.zeros(depths, bool))
        valid.setdefault(key, np.zeros(depths, bool))
        if want is not None:
            hits[key][d] = v == want
            valid[key][d] = True
    if not hits:
        return None
    verified = trace.rows(VERIFY_ACCEPT_LEN).numpy().reshape(-1) if VERIFY_ACCEPT_LEN in names \
        else np.zeros(0)
    h, ok = np.stack(list(hits.values())), np.stack(list(valid.values()))
    rows = ok.sum(axis=0)
    if not rows.any():
        return None
    lead = leading_hits(h, ok)
    scored = lead[lead >= 0]
    correct = (h & ok).sum(axis=0)
    return Acceptance(depth_accuracy=[int(c) / int(n) if n else math.nan for c, n in zip(correct, rows)],
                      depth_rows=rows.tolist(),
                      expected_accept_len=1 + float(scored.mean()) if len(scored) else math.nan,
                      chains=len(scored), scored_on="the server's chains" if anchors else "every row",
                      chains_unscored=len(lead) - len(scored), server_verifies=len(verified),
                      server_accept_len=1 + float(verified.mean()) if len(verified) else None)
