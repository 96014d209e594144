"""When rows count as equal: defaults by dtype, overridable per name glob with a tiny grammar.

``--tol 'draft.*:cos>=0.999,max_abs<=1e-2'``: a glob, a colon, then comma-separated
``metric OP number`` bounds (OP one of <=, >=, <, >). Parsed with a regex, never eval().
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np

OPS: dict[str, Callable] = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
ALIASES = {"cos": "cosine"}
METRICS = {"max_abs", "mean_abs", "rel_l2", "cosine", "max_rel", "argmax_agree", "topk_overlap", "kl"}
BOUND = re.compile(r"^\s*([a-z_][a-z0-9_]*)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*$")

# Bounds a row must meet, by the looser dtype of the two sides: noise of the format, not of the model.
DEFAULTS: dict[str, dict[str, tuple[str, float]]] = {
    "float64": {"max_rel": ("<=", 1e-9), "cosine": (">=", 1 - 1e-12)},
    "float32": {"max_rel": ("<=", 1e-5), "cosine": (">=", 1 - 1e-9)},
    "float16": {"max_rel": ("<=", 4e-3), "cosine": (">=", 0.9999)},
    "bfloat16": {"max_rel": ("<=", 3e-2), "cosine": (">=", 0.999)},
}
LOOSENESS = ["float64", "float32", "float16", "bfloat16"]


@dataclass
class Tolerances:
    """Per-glob bounds from --tol, first match wins; otherwise the dtype defaults."""

    rules: list[tuple[str, dict[str, tuple[str, float]]]] = field(default_factory=list)

    @classmethod
    def parse(cls, specs: list[str]) -> Tolerances:
        rules = []
        for spec in specs:
            glob, sep, body = spec.partition(":")
            if not sep or not glob.strip():
                raise ValueError(f"tolerance {spec!r}: expected GLOB:metric OP number[,...]")
            bounds = {}
            for part in body.split(","):
                m = BOUND.match(part)
                if not m:
                    raise ValueError(f"tolerance {spec!r}: cannot read {part.strip()!r}")
                metric = ALIASES.get(m.group(1), m.group(1))
                if metric not in METRICS:
                    raise ValueError(f"tolerance {spec!r}: unknown metric {m.group(1)!r}")
                bounds[metric] = (m.group(2), float(m.group(3)))
            rules.append((glob.strip(), bounds))
        return cls(rules)

    def bounds(self, name: str, dtypes: tuple[str, str]) -> dict[str, tuple[str, float]]:
        for glob, bounds in self.rules:
            if fnmatchcase(name, glob):
                return bounds
        floats = [d for d in dtypes if d in DEFAULTS]
        return DEFAULTS[max(floats, key=LOOSENESS.index)] if floats else {}


def failing_rows(metrics: dict[str, np.ndarray], bounds: dict[str, tuple[str, float]]) -> np.ndarray:
    """Rows that break any bound (a NaN metric breaks it too)."""
    n = len(next(iter(metrics.values())))
    bad = np.zeros(n, dtype=bool)
    for metric, (op, limit) in bounds.items():
        if metric in metrics:
            values = metrics[metric]
            bad |= ~OPS[op](values, limit) | np.isnan(values)
    if "equal" in metrics:
        bad |= metrics["equal"] < 1
    return bad
