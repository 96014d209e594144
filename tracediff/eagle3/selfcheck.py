"""Replay's self-check: fed a serving trace's own recorded chain inputs, the draft must reproduce
the chains that trace recorded, token for token; where it does not, that is the finding, named by
where the replay first leaves the recorded draft.

A chain is the server's draft from one row (its anchor: the last row of a forward) at depths
0..k-1, each depth fed the token the server fed it (``draft.input_ids`` at that depth: the text at
depth 0, its own previous draft after). Replayed with exactly those inputs, a draft computed as the
server computes it gives the recorded ``draft.token`` at every depth and ``draft.hidden`` up to
float rounding; a server that reads the draft's config otherwise (``norm_output``, ``rope_theta``)
leaves it at the first depth the reading touches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from tracediff.eagle3.draft import DepthResult
from tracediff.eagle3.names import DRAFT_HIDDEN, DRAFT_INPUT_IDS, DRAFT_TOKEN, DRAFT_TOKEN_TARGET
from tracediff.trace.dtypes import decode
from tracediff.trace.reader import RowKeys, TensorRows, Trace

HIDDEN_RTOL = 1e-3  # max |replayed - recorded| / max |recorded| of a row's draft.hidden still "the same"
CHAIN_TENSORS = (DRAFT_INPUT_IDS, DRAFT_TOKEN, DRAFT_TOKEN_TARGET, DRAFT_HIDDEN)
LARGE = (DRAFT_HIDDEN,)  # read a request at a time: a row is a hidden state


@dataclass(frozen=True)
class Departure:
    """Where a replayed chain first leaves the recorded one."""

    request: str
    position: int  # the chain's anchor row
    depth: int
    tensor: str  # "draft.token", "draft.token_target" or "draft.hidden"
    detail: str  # e.g. "recorded 532, replayed 17" or "max_rel 0.78"


@dataclass
class SelfCheck:
    """The chains compared, how many replay reproduced at every depth, the largest relative
    difference of ``draft.hidden`` over them, and the first departure (None: none left)."""

    chains: int = 0
    reproduced: int = 0
    hidden_max_rel: float = 0.0
    first_departure: Departure | None = None
    suspect: str | None = None  # a reading of the draft config that explains the departure, if one does

    def to_dict(self) -> dict:
        return asdict(self)


class RecordedChains:
    """A serving trace's recorded chain rows, by (request, anchor position, depth)."""

    def __init__(self, trace: Trace) -> None:
        names = set(trace.names())
        present = [name for name in CHAIN_TENSORS if name in names]
        self.trace = trace
        # ids are read whole (one int a row); a hidden state a request at a time (``value``)
        self.rows: dict[str, TensorRows] = {name: trace.rows(name) for name in present if name not in LARGE}
        self.values = {name: rows.numpy() for name, rows in self.rows.items()}  # decoded once
        self.keys: dict[str, RowKeys] = {name: trace.keys(name) for name in present if name in LARGE}
        self.at: dict[str, dict[tuple[str, int, int], int]] = {
            name: {(r, int(p), int(d)): i for i, (r, p, d) in
                   enumerate(zip(rows.request.tolist(), rows.position.tolist(), rows.depth.tolist()))}
            for name, rows in [*self.rows.items(), *self.keys.items()]}
        self.of_request = {name: _rows_by_request(keys) for name, keys in self.keys.items()}
        self._request: dict[str, tuple[str, dict[int, int], np.ndarray]] = {}  # name -> one request's rows

    @property
    def usable(self) -> bool:
        """Whether the trace holds what a self-check needs: the fed tokens and the drafted ones."""
        return DRAFT_INPUT_IDS in self.rows and DRAFT_TOKEN in self.rows

    def value(self, name: str, request: str, position: int, depth: int) -> np.ndarray | None:
        i = self.at.get(name, {}).get((request, position, depth))
        if i is None:
            return None
        if name not in self.keys:
            return self.values[name][i]
        held = self._request.get(name)
        if held is None or held[0] != request:  # the request's rows of a large tensor, read once
            keys, rows = self.keys[name], self.of_request[name][request]
            held = request, {int(r): k for k, r in enumerate(rows.tolist())}, \
                decode(self.trace.gather(keys, rows), keys.dtype)
            self._request[name] = held
        return held[2][held[1][i]]

    def fed(self, request: str, anchors: np.ndarray, positions: np.ndarray, teacher: torch.Tensor,
            depths: int) -> list[torch.Tensor]:
        """Per depth, the ids to feed ([1, rows]): the teacher-forced ones, with each anchor row's
        replaced by the token its chain was fed at that depth where recorded."""
        fed = []
        ids = teacher.clone()
        for depth in range(depths):
            at = ids.clone()
            for row in anchors.tolist():
                token = self.value(DRAFT_INPUT_IDS, request, int(positions[row]), depth)
                if token is not None:
                    at[0, row] = int(token)
            fed.append(at)
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        return fed

    def compare(self, check: SelfCheck, request: str, anchors: np.ndarray, positions: np.ndarray,
                results: list[DepthResult], to_target=None) -> None:
        """Fold one request's replayed chains (``results`` of an unroll fed by ``fed``) into ``check``;
        ``to_target`` (draft ids -> target ids under replay's d2t reading) checks the recorded
        ``draft.token_target`` too: the target tokens the figure is scored on."""
        for row in anchors.tolist():
            position = int(positions[row])
            same, compared = True, False
            for depth, result in enumerate(results):
                token = self.value(DRAFT_TOKEN, request, position, depth)
                if token is None:
                    break
                compared = True
                replayed = int(result.logits[0, row].argmax())
                departure = None
                if replayed != int(token):
                    departure = Departure(request, position, depth, DRAFT_TOKEN,
                                          f"recorded {int(token)}, replayed {replayed}")
                mapped = self.value(DRAFT_TOKEN_TARGET, request, position, depth)
                if departure is None and mapped is not None and to_target is not None:
                    target = int(to_target(torch.tensor([replayed]))[0])
                    if target != int(mapped):
                        departure = Departure(request, position, depth, DRAFT_TOKEN_TARGET,
                                              f"recorded {int(mapped)}, replayed {target} (draft id "
                                              f"{replayed}: the vocab map is read otherwise)")
                hidden = self.value(DRAFT_HIDDEN, request, position, depth)
                if hidden is not None:
                    ours = result.hidden[0, row].float().numpy()
                    scale = float(np.abs(hidden).max()) or 1.0
                    rel = float(np.abs(ours - hidden).max()) / scale
                    check.hidden_max_rel = max(check.hidden_max_rel, rel)
                    if rel > HIDDEN_RTOL:  # the state leaves first: name it over the token it moves
                        departure = Departure(request, position, depth, DRAFT_HIDDEN, f"max_rel {rel:.3g}")
                if departure is not None:
                    same = False
                    if check.first_departure is None:
                        check.first_departure = departure
                    break
            if compared:
                check.chains += 1
                check.reproduced += int(same)


def _rows_by_request(keys: RowKeys) -> dict[str, np.ndarray]:
    """Each request's rows (indices into ``keys``), found in one sort."""
    order = np.argsort(keys.request_code, kind="stable")
    codes = keys.request_code[order]
    starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]]) if len(codes) else np.zeros(0, int)
    return {str(keys.request[order[s]]): order[s:e] for s, e in zip(starts, np.r_[starts[1:], len(codes)])}
