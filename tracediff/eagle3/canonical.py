"""Logging EAGLE-3 tensors under their canonical names, the same way for every producer.

Row keys: a target row and a depth-0 draft row at row t carry (request, t, token x[t]). A draft row
at depth d > 0 carries the key of the row its chain grew from (the anchor): what was fed at each
depth is in ``draft.input_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tracediff.eagle3 import names as tn
from tracediff.eagle3.capture import TargetStates
from tracediff.eagle3.draft import DepthResult
from tracediff.record.recorder import Recorder


def log_vocab_map(rec: Recorder | None, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """The draft's vocab map as static records, once per trace: compare uses it to tell a d2t that
    differs from one that is read differently."""
    if rec is not None:
        rec.log_static(tn.DRAFT_D2T, d2t, once=True)
        rec.log_static(tn.DRAFT_T2D, t2d, once=True)


class RowLogger:
    """Logs [rows, ...] tensors of one request with their keys; a no-op without a recorder. Rows
    before ``first_row`` are not logged (a prefix-cache hit: the producer computed them earlier)."""

    def __init__(self, rec: Recorder | None, request: str, tokens: Sequence[int] | np.ndarray,
                 first_row: int = 0) -> None:
        self.rec = rec
        self.request = request
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.first_row = first_row

    def log(self, name: str, values: torch.Tensor, rows: Sequence[int], step: int, depth: int = 0) -> None:
        if self.rec is None:
            return
        at = np.asarray(rows, dtype=np.int64)
        if self.first_row and (at < self.first_row).any():
            keep = at >= self.first_row
            if not keep.any():
                return
            at, values = at[keep], values[torch.from_numpy(keep)]
        self.rec.log(name, values, step=step, depth=depth, request=self.request, positions=at,
                     token_ids=self.tokens[at])

    def target(self, states: TargetStates, rows: Sequence[int], step: int, aux: torch.Tensor,
               layers: Sequence[str] | None = None) -> None:
        """target.embed, target.layer.i, target.aux, target.logits, target.token for ``rows`` of batch 0."""
        index = torch.as_tensor(list(rows))
        for name, value in states.states.items():
            if layers is None or name in layers:
                self.log(name, value[0, index], rows, step)
        self.log(tn.TARGET_AUX, aux[0, index], rows, step)
        logits = states.logits[0, index]
        self.log(tn.TARGET_LOGITS, logits, rows, step)
        self.log(tn.TARGET_TOKEN, logits.argmax(-1), rows, step)

    def draft(self, result: DepthResult, input_ids: torch.Tensor, rows: Sequence[int], step: int, depth: int,
              to_target: Callable[[torch.Tensor], torch.Tensor], fc_in: torch.Tensor | None = None,
              rope_positions: Sequence[int] | None = None) -> None:
        """The draft tensors of one depth; every tensor is [1, R, ...] over ``rows`` (batch of one).
        ``rope_positions``: the RoPE positions the draft used, by default row + depth (SpecForge's TTT
        and SGLang's draft chain both rotate row t at depth d by position t + d)."""
        if fc_in is not None:
            self.log(tn.DRAFT_FC_IN, fc_in[0], rows, step, depth)
        if result.fc_out is not None:
            self.log(tn.DRAFT_FC_OUT, result.fc_out[0], rows, step, depth)
        rope = [r + depth for r in rows] if rope_positions is None else list(rope_positions)
        self.log(tn.DRAFT_POSITIONS, torch.tensor(rope, dtype=torch.int64), rows, step, depth)
        token = result.logits[0].argmax(-1)
        for name, value in ((tn.DRAFT_INPUT_IDS, input_ids[0]), (tn.DRAFT_EMBED, result.embed[0]),
                            (tn.DRAFT_HIDDEN, result.hidden[0]), (tn.DRAFT_LOGITS, result.logits[0]),
                            (tn.DRAFT_TOKEN, token), (tn.DRAFT_TOKEN_TARGET, to_target(token))):
            self.log(name, value, rows, step, depth)
