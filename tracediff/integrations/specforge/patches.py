"""SpecForge functions wrapped while any recording is installed, and what they report, per thread.

The step (``Eagle3TrainStrategy.forward_loss``) notes its batch for the forward it runs, and RoPE
(``llama3_eagle.apply_rotary_pos_emb``) reports the positions it rotates at. Both only observe.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

local = threading.local()  # .batch: the step's note; .rope: where apply_rotary_pos_emb reports


@dataclass
class BatchNote:
    input_ids: Any  # [B, L] before SpecForge's shift
    sample_ids: Sequence[str] | None = None
    step: int | None = None


class ProcessPatches:
    """SpecForge functions wrapped while any recording is installed: the step notes its batch, and
    RoPE reports the positions it rotates at. Both only observe, and only for this thread."""

    def __init__(self) -> None:
        self.count = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def acquire(self) -> None:
        self.count += 1
        if self.count == 1:
            llama = importlib.import_module("specforge.modeling.draft.llama3_eagle")
            strategy = importlib.import_module("specforge.training.strategies.base").Eagle3TrainStrategy
            self._wrap(llama, "apply_rotary_pos_emb", _rope_reporting)
            self._wrap(strategy, "forward_loss", _batch_noting)

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            for owner, name, original in reversed(self.saved):
                setattr(owner, name, original)
            self.saved = []

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name]
        self.saved.append((owner, name, original))
        setattr(owner, name, make(original))


def _rope_reporting(original: Any) -> Any:
    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, *args: Any,
                             **kwargs: Any) -> Any:
        report = getattr(local, "rope", None)
        if report is not None:
            report(position_ids)
        return original(q, k, cos, sin, position_ids, *args, **kwargs)

    return apply_rotary_pos_emb


def _batch_noting(original: Any) -> Any:
    def forward_loss(self: Any, batch: Any, ctx: Any = None) -> Any:
        saved = getattr(local, "batch", None)
        try:
            local.batch = BatchNote(batch.tensors.get("input_ids"), list(batch.sample_ids),
                                      getattr(ctx, "global_step", None))
        except Exception:  # a batch of another shape: recorded without a note (warned at the forward)
            local.batch = None
        try:
            return original(self, batch, ctx)
        finally:
            local.batch = saved

    return forward_loss


patches = ProcessPatches()


__all__ = ["BatchNote", "local", "patches"]
