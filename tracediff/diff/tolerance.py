"""When rows count as equal: defaults by dtype, overridable per name glob with a tiny grammar.

``--tol 'draft.*:cos>=0.999,max_abs<=1e-2'``: a glob, a colon, then comma-separated
``metric OP number`` bounds (OP one of <=, >=, <, >). Parsed with a regex, never eval().
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np

OPS: dict[str, Callable] = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
ALIASES = {"cos": "cosine"}
METRICS = {"max_abs", "mean_abs", "rel_l2", "cosine", "max_rel", "argmax_agree", "topk_overlap", "kl",
           "equal"}
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
        rules: list[tuple[str, dict[str, tuple[str, float]]]] = []
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
                if metric in bounds:  # one bound per metric: a second would silently replace the first
                    raise ValueError(f"tolerance {spec!r}: {metric} is bounded twice")
                bounds[metric] = (m.group(2), float(m.group(3)))
            if any(glob.strip() == other for other, _ in rules):
                raise ValueError(f"tolerance {spec!r}: the glob {glob.strip()!r} is given twice")
            rules.append((glob.strip(), bounds))
        return cls(rules)

    def rule(self, name: str) -> tuple[str, dict[str, tuple[str, float]]] | None:
        """The first --tol rule whose glob matches ``name``."""
        return next(((glob, bounds) for glob, bounds in self.rules if fnmatchcase(name, glob)), None)

    def bounds(self, name: str, dtypes: tuple[str, str],
               metrics: Collection[str] | None = None) -> dict[str, tuple[str, float]]:
        """The matching rule's bounds; the dtype defaults when no rule matches, or when the rule
        bounds none of ``metrics`` (the ones the tensor has): a rule that checks nothing of a
        tensor must not leave it unchecked (``unused_rule`` says so)."""
        rule = self.rule(name)
        if rule is not None and (metrics is None or rule[1].keys() & set(metrics)):
            return rule[1]
        floats = [d for d in dtypes if d in DEFAULTS]
        return DEFAULTS[max(floats, key=LOOSENESS.index)] if floats else {}

    def unused_rule(self, name: str, metrics: Collection[str]) -> str:
        """A note when the rule matching ``name`` bounds a metric the tensor lacks (an integer
        tensor has no cosine, only logits have kl), else '': such a bound checks nothing, and a
        user reading the rule would think it did."""
        rule = self.rule(name)
        absent = [] if rule is None else [m for m in rule[1] if m not in metrics]
        if rule is None or not absent:
            return ""
        has = ", ".join(sorted(metrics))
        if len(absent) == len(rule[1]):
            return f"--tol {rule[0]}:{','.join(rule[1])} bounds no metric of this tensor (it has {has}): " \
                   "the default bounds were used"
        return (f"--tol {rule[0]}: this tensor has no {', '.join(absent)} (it has {has}): that bound checks "
                "nothing here, the rule's other bounds apply")


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
