"""What each slot of an engine's packed aux really holds, measured once in the serving process (SGLang, vLLM).

While a capture is pending, the hooks keep the last row of every target state of one forward (the
stream entering each layer, each layer's branch output); the aux's last row, cut into slots of the
hidden width, is matched against them. The contract then says ``aux_slot_states``: per slot
``target.embed``, ``target.layer.{i}``, ``target.layer.{i}.branch`` (a layer's branch output, not
the residual stream: Gemma 3), or None (equal to no state). Costs one row per layer, once.
"""

from __future__ import annotations

from typing import Any

SAME = 1e-3  # max |slot - state| / max |state| below which a slot is that state (bf16 rounds at 4e-3 per op)


class SlotProbe:
    """Keeps one row per state while a measure is wanted; ``measure`` answers once per capture."""

    def __init__(self) -> None:
        self.wanted = False
        self.states: dict[str, Any] = {}

    def expect(self) -> None:
        """A capture was (re)configured: measure at the next forward that hands on an aux."""
        self.wanted, self.states = True, {}

    def begin(self) -> None:
        if self.wanted:
            self.states = {}

    def keep(self, name: str, tensor: Any) -> None:
        if self.wanted and tensor.ndim == 2 and tensor.shape[0]:
            self.states[name] = tensor[-1].detach().float().clone()

    def measure(self, aux: Any, rows: int, requests: int) -> list[str | None] | None:
        """Per slot of ``aux`` (its rows: every row of the forward, or one per request; its last row
        is the forward's last row either way), the state it equals; None while there is nothing to
        measure (no capture pending, no state kept, rows that fit neither reading)."""
        if not self.wanted or not self.states or aux.ndim != 2 or aux.shape[0] not in (rows, requests):
            return None
        width = next(iter(self.states.values())).numel()
        row = aux[-1].detach().float()
        if not width or row.numel() % width:
            return None
        self.wanted = False
        states, self.states = self.states, {}
        return [_which(slot, states) for slot in row.reshape(-1, width)]


def _which(slot: Any, states: dict[str, Any]) -> str | None:
    """The state ``slot`` equals (the closest within SAME; residual-stream states before branches)."""
    best, best_err = None, SAME
    for name in sorted(states, key=lambda n: n.endswith(".branch")):
        ref = states[name]
        if ref.shape != slot.shape:
            continue
        scale = float(ref.abs().max())
        err = float((slot - ref).abs().max()) / scale if scale > 0 else float((slot - ref).abs().max())
        if err < best_err or (best is None and err <= best_err):
            best, best_err = name, err
    return best
