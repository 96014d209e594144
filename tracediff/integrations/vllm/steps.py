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
        texts = BatchText.of(self.requests, text)
        token, target_ok = texts.at(owner, self.position)
        target_ok &= token == self.fed
        out = {TARGET: _rows(target_ok, np.arange(len(target_ok)), request, token, self.position)}
        if self.logits_rows is not None:
            out[LOGITS] = _rows(target_ok, self.logits_rows, request, token, self.position)
        draft_ok = None
        if self.draft_position is not None and self.draft_fed is not None and \
                np.array_equal(self.draft_position, self.position):
            following, has_next = texts.at(owner, self.position + 1)
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


@dataclass(frozen=True)
class BatchText:
    """The committed texts of a step's batch laid end to end, so that every row's token is read in
    a few array operations, not one pass per request."""

    flat: np.ndarray
    start: np.ndarray  # per batch request: where its text begins in ``flat``
    length: np.ndarray  # per batch request: its length (0: no text, a request not recorded)

    @classmethod
    def of(cls, requests: Sequence[str], text: Mapping[str, np.ndarray]) -> BatchText:
        parts = [text.get(r, _NO_TEXT) for r in requests]
        length = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        start = np.cumsum(length) - length
        return cls(np.concatenate(parts) if parts else _NO_TEXT, start, length)

    def at(self, owner: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row (of batch request ``owner``), its request's token at ``position`` and whether
        there is one."""
        ok = (position >= 0) & (position < self.length[owner])
        token = np.full(len(position), -1, dtype=np.int64)
        token[ok] = self.flat[self.start[owner[ok]] + position[ok]]
        return token, ok


_NO_TEXT = np.zeros(0, dtype=np.int64)


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


class ClientText:
    """A request's tokens as its client receives them, grown step by step: the worker's output cut
    where vLLM 0.32's scheduler stops the request (``check_stop``: an EOS or stop token id, kept;
    ``max_tokens``; the model length). The worker keeps every token its verify accepted, also past
    that end. Stop strings and repetition detection end a request in vLLM's frontend, after the
    worker generated on: those ends are not known here (hooks.py states it in the contract). Each
    ``extend`` reads only the output tokens it has not seen (the worker's output list only grows), so
    a step costs the new tokens, not the whole text."""

    def __init__(self, prompt: Sequence[int], *, max_tokens: int | None, eos: int | None,
                 stop_ids: Sequence[int] | None, max_model_len: int | None) -> None:
        self.prompt = np.asarray([int(t) for t in prompt], dtype=np.int64)
        self.max_tokens, self.eos, self.max_model_len = max_tokens, eos, max_model_len
        self.stops = frozenset(int(t) for t in (stop_ids or ()))
        self.kept: list[int] = []
        self.read = 0  # output tokens seen
        self.ended = False
        self.tokens = self.prompt

    def extend(self, output: Sequence[int]) -> np.ndarray:
        """The text after the worker's ``output`` (the same list as before, grown)."""
        if self.ended or len(output) <= self.read:
            return self.tokens
        grown = len(self.kept)
        for tok in output[self.read:]:
            self.read += 1
            self.kept.append(int(tok))
            if self._stops_after(int(tok)):
                self.ended = True
                break
        if len(self.kept) > grown:
            self.tokens = np.concatenate([self.prompt, np.asarray(self.kept, dtype=np.int64)])
        return self.tokens

    def _stops_after(self, tok: int) -> bool:
        return (self.eos is not None and tok == self.eos) or tok in self.stops or \
            (self.max_tokens is not None and len(self.kept) >= self.max_tokens) or \
            (self.max_model_len is not None and len(self.prompt) + len(self.kept) >= self.max_model_len)


def client_text(prompt: Sequence[int], output: Sequence[int], *, max_tokens: int | None,
                eos: int | None, stop_ids: Sequence[int] | None, max_model_len: int | None) -> np.ndarray:
    """A request's tokens as its client receives them, at once (``ClientText``)."""
    return ClientText(prompt, max_tokens=max_tokens, eos=eos, stop_ids=stop_ids,
                      max_model_len=max_model_len).extend(output)
