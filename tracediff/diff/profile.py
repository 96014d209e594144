"""Per-cell error of one tensor while its chunks are measured: the data behind the HTML report's
heatmap and error curves, kept in fixed-size arrays so that memory does not grow with the trace.

A cell is one draft depth and ``bucket`` consecutive positions; ``bucket`` is chosen from the
tensor's largest position before any row is read, so a tensor never has more than ``MAX_CELLS``
cells per depth. Worst values fold with ``np.minimum.at`` / ``np.maximum.at``, which propagate NaN:
a cell holding a NaN row shows NaN, never a finite value that hides it.
"""

from __future__ import annotations

import numpy as np

from tracediff.diff.results import Profile

MAX_CELLS = 256  # position cells per depth


class ProfileTally:
    """Rows, failures and worst cosine / rel_l2 per (depth, position cell) of one tensor."""

    def __init__(self, max_position: int, max_depth: int) -> None:
        self.bucket = max(1, -(-(max(max_position, 0) + 1) // MAX_CELLS))
        self.cells = -(-(max(max_position, 0) + 1) // self.bucket)
        size = (max(max_depth, 0) + 1) * self.cells
        self.rows = np.zeros(size, np.int64)
        self.failed = np.zeros(size, np.int64)
        self.cosine = np.full(size, np.inf)
        self.rel_l2 = np.full(size, -np.inf)
        self.floats = False

    def add(self, positions: np.ndarray, depths: np.ndarray, bad: np.ndarray,
            metrics: dict[str, np.ndarray]) -> None:
        """Fold one chunk's rows (their positions and depths on the baseline side) in."""
        cell = depths.astype(np.int64) * self.cells + positions.astype(np.int64) // self.bucket
        np.add.at(self.rows, cell, 1)
        np.add.at(self.failed, cell, bad.astype(np.int64))
        if "cosine" in metrics:
            self.floats = True
            with np.errstate(invalid="ignore"):  # NaN rows are meant to win
                np.minimum.at(self.cosine, cell, metrics["cosine"])
                np.maximum.at(self.rel_l2, cell, metrics["rel_l2"])

    def profile(self) -> Profile | None:
        """The cells that hold a compared row; None when none does."""
        used = np.flatnonzero(self.rows)
        if not len(used):
            return None

        def worst(values: np.ndarray) -> list[float | None]:
            return [float(v) for v in values[used]] if self.floats else [None] * len(used)

        return Profile(bucket=self.bucket, depth=(used // self.cells).tolist(),
                       position=((used % self.cells) * self.bucket).tolist(), rows=self.rows[used].tolist(),
                       failed=self.failed[used].tolist(), cosine=worst(self.cosine),
                       rel_l2=worst(self.rel_l2))
