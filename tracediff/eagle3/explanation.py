"""What ``tracediff explain`` measured and concluded, as plain typed data: one ``Run`` per replay
and the ``Explanation`` that holds them, versioned and round-tripping JSON like ``Report``.
No torch here: a bundle and the renderers read an explanation without running a draft.

The computation is ``tracediff/eagle3/explain.py``; the JSON fields are documented in docs/EXPLAIN.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tracediff.jsonio import dumps, loads_versioned

EXPLANATION_VERSION = 3  # 2: recorded_logits_max_diff, unpaired by reason, rows_left; 3: chains_unscored
Side = Literal["a", "b"]
GROUPS = ("fc_in", "input_ids", "positions", "d2t", "draft")  # the draft's input groups, swapped one by one
GROUP_NAMES = {"fc_in": "fc input", "input_ids": "fed token ids", "positions": "positions",
               "d2t": "vocab map (d2t)", "draft": "draft computation"}


@dataclass
class Run:
    """One replay: which side each input group came from, and what it scored."""

    name: str  # "A's inputs", "B with A's fc input", ...
    base: Side
    swapped: list[str]  # groups taken from the other side
    expected_accept_len: float  # over the chains every run scores (``chains``): like compared with like
    chains: int
    own_accept_len: float  # over the chains this run scores (every depth's target token recorded)
    own_chains: int
    depth_accuracy: list[float]
    depth_rows: list[int]


@dataclass
class Explanation:
    """What explain measured and concluded (``to_json`` / ``from_json`` round-trip it)."""

    a: str
    b: str
    conclusion: str
    restored_by: str | None  # the run whose swap restores acceptance (``conclusion`` names it), if one does
    scored_on: str  # "the server's chains" or "every row"
    depths: int
    depths_from: str
    requests: int  # request pairs replayed
    rows: int  # rows they share
    differing: list[str]  # input groups whose values differ between the sides
    cost: float  # A's accept length - B's
    noise: float  # what a difference must exceed to count (NOISE_SE standard errors)
    chains_unscored: int  # chains left out of every run: some depth has no recorded target token
    runs: list[Run] = field(default_factory=list)
    recorded_agreement: dict[str, float | None] = field(default_factory=dict)  # side -> share of rows
    recorded_logits_max_diff: dict[str, float | None] = field(default_factory=dict)  # side -> max |diff|
    # side -> reason -> requests left unpaired, never replayed (reasons: explain.UNPAIRED)
    unpaired: dict[str, dict[str, int]] = field(default_factory=dict)
    rows_left: dict[str, int] = field(default_factory=dict)  # side -> rows never replayed
    explanation_version: int = EXPLANATION_VERSION

    def run(self, name: str) -> Run:
        return next(r for r in self.runs if r.name == name)

    def to_json(self, indent: int | None = 1) -> str:
        return dumps(self, indent)

    @classmethod
    def from_json(cls, text: str) -> Explanation:
        """The explanation ``to_json`` wrote; ValueError for another version or shape."""
        return loads_versioned(cls, text, "explanation_version", EXPLANATION_VERSION, "explanation")
