"""Row keys of one vLLM engine step, decided once the step's tokens are committed: numpy only.

A step runs the target over every scheduled row (prefill chunks, decode rows, verify rows holding the
bonus token and the drafts), samples, runs the draft's first pass over the same rows (fed the tokens
shifted by one) and then one row per request per further draft step. Which of those rows hold the
request's real text is known only after sampling: a verify row of a rejected draft does not. So the
hooks keep what they see, with the rows' positions and fed tokens, and ``StepRows.resolve`` keys it
at the step's end against each request's committed tokens (prompt + output, cut where the client's
text ends):

- a target row at position p fed token y is kept iff y is the request's token at p; key (r, p, x[p]);
- a first-pass draft row at p fed y (its target row kept) iff y == x[p + 1]; key (r, p, x[p]);
- the draft's sample rows (one per request: its anchor) and every later depth carry the anchor's key;
- a verify outcome (accepted drafts) is keyed at the anchor of the chain it verified (last step's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# the row sets a tensor of a step is cut along
TARGET, LOGITS, DRAFT0, ANCHOR, VERIFY = "target", "logits", "draft0", "anchor", "verify"


@dataclass(frozen=True)
class Keys:
    """The keys of the kept rows of one row set: ``index`` into the tensor's rows, and per kept row
    its request, position and token (the request's token at that position)."""

    index: np.ndarray
    request: np.ndarray
    position: np.ndarray
    token: np.ndarray

    @classmethod
    def none(cls) -> Keys:
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, np.zeros(0, dtype=object), empty, empty)

    def kwargs(self) -> dict[str, Any]:
        return dict(request=self.request, positions=self.position, token_ids=self.token)


@dataclass
class StepRows:
    """What one step's hooks saw of its rows (numpy, on the host)."""

    requests: list[str]  # the batch, in batch order
    starts: np.ndarray  # query_start_loc: rows [starts[b], starts[b+1]) are request b's
    position: np.ndarray  # per target row
    fed: np.ndarray  # per target row: the token the target was fed
    logits_rows: np.ndarray | None = None  # the target rows the logits were computed at
    draft_position: np.ndarray | None = None  # per first-pass draft row
    draft_fed: np.ndarray | None = None
    anchors: np.ndarray | None = None  # per batch request: the first-pass row its chain grew from
    accepted: dict[str, int] = field(default_factory=dict)  # per request verified this step

    @property
    def owner(self) -> np.ndarray:
        """The batch index of every target row."""
        return np.repeat(np.arange(len(self.requests)), np.diff(self.starts))

    def resolve(self, text: Mapping[str, np.ndarray], last_anchor: Mapping[str, tuple[int, int]]
                ) -> dict[str, Keys]:
        """Keys per row set, against each request's committed ``text``; ``last_anchor`` per request:
        (position, token) of the chain drafted last step (the one this step verified)."""
        owner = self.owner
        request = np.asarray(self.requests, dtype=object)[owner] if len(owner) else np.zeros(0, dtype=object)
        token, target_ok = _text_at(request, self.position, text)
        target_ok &= token == self.fed
        out = {TARGET: _rows(target_ok, np.arange(len(target_ok)), request, token, self.position)}
        if self.logits_rows is not None:
            out[LOGITS] = _rows(target_ok, self.logits_rows, request, token, self.position)
        draft_ok = None
        if self.draft_position is not None and self.draft_fed is not None and \
                np.array_equal(self.draft_position, self.position):
            following, has_next = _text_at(request, self.position + 1, text)
            draft_ok = target_ok & has_next & (following == self.draft_fed)
            out[DRAFT0] = _rows(draft_ok, np.arange(len(draft_ok)), request, token, self.position)
        if self.anchors is not None and draft_ok is not None and len(self.anchors) == len(self.requests):
            out[ANCHOR] = _rows(draft_ok, self.anchors, request, token, self.position)
        verified = [(i, r) for i, r in enumerate(self.requests) if r in self.accepted and r in last_anchor]
        ok_rows = [(i, r) for i, r in verified if _holds(text.get(r), *last_anchor[r])]
        out[VERIFY] = Keys(np.array([i for i, _ in ok_rows], dtype=np.int64),
                           np.array([r for _, r in ok_rows], dtype=object),
                           np.array([last_anchor[r][0] for _, r in ok_rows], dtype=np.int64),
                           np.array([last_anchor[r][1] for _, r in ok_rows], dtype=np.int64))
        return out


def anchors_of(keys: Keys, requests: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per request, the (position, token) of the chain it drafted this step."""
    picked = {str(r): (int(p), int(t)) for r, p, t in zip(keys.request.tolist(), keys.position.tolist(),
                                                            keys.token.tolist())}
    return {r: picked[r] for r in requests if r in picked}


def _text_at(request: np.ndarray, position: np.ndarray, text: Mapping[str, np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the request's committed token at ``position`` and whether there is one."""
    token = np.full(len(position), -1, dtype=np.int64)
    ok = np.zeros(len(position), dtype=bool)
    for name in set(request.tolist()):
        tokens = text.get(name)
        if tokens is None:
            continue
        rows = request == name
        inside = rows & (position >= 0) & (position < len(tokens))
        token[inside] = tokens[position[inside]]
        ok |= inside
    return token, ok


def _holds(tokens: np.ndarray | None, position: int, token: int) -> bool:
    return tokens is not None and 0 <= position < len(tokens) and int(tokens[position]) == token


def _rows(ok: np.ndarray, rows: np.ndarray, request: np.ndarray, token: np.ndarray, position: np.ndarray
          ) -> Keys:
    """Keys of a tensor whose row i is step row ``rows[i]``: the rows whose step row is kept."""
    rows = np.asarray(rows, dtype=np.int64)
    valid = (rows >= 0) & (rows < len(ok))
    valid[valid] &= ok[rows[valid]]
    at = np.flatnonzero(valid)
    src = rows[at]
    return Keys(at, request[src], position[src], token[src])


def client_text(prompt: Sequence[int], output: Sequence[int], *, max_tokens: int | None,
                eos: int | None, stop_ids: Sequence[int] | None, max_model_len: int | None) -> np.ndarray:
    """A request's tokens as its client receives them: the worker's output cut where vLLM 0.32's
    scheduler stops the request (``check_stop``: an EOS or stop token id, kept; ``max_tokens``; the
    model length). The worker keeps every token its verify accepted, also past that end."""
    kept: list[int] = []
    stops = set(int(t) for t in (stop_ids or ()))
    for tok in output:
        kept.append(int(tok))
        if (eos is not None and int(tok) == eos) or int(tok) in stops:
            break
        if max_tokens is not None and len(kept) >= max_tokens:
            break
        if max_model_len is not None and len(prompt) + len(kept) >= max_model_len:
            break
    return np.asarray([*map(int, prompt), *kept], dtype=np.int64)
