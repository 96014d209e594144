"""What a diagnosis says: a stable kind, one line for people, the numbers behind it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Diagnosis:
    kind: str  # aux_layer_set | aux_order | layer_offset | ... (docs/REPORT.md)
    message: str
    evidence: dict = field(default_factory=dict)
