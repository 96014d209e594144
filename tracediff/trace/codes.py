"""Strings to small integer codes (request ids to request codes) with numpy alone: one sort of
fixed-width strings in C, no Python step per row and no pyarrow, so a reader of an HDF5 trace
never loads Arrow."""

from __future__ import annotations

import numpy as np


def factorize(values: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(the distinct strings in order of first appearance, each value's index into them)."""
    if not len(values):
        return [], np.empty(0, dtype=np.int64)
    fixed = np.asarray(values, dtype=str)
    _, first, inverse = np.unique(fixed, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # sorted distinct strings -> order of first appearance
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return fixed[first[order]].tolist(), rank[inverse.reshape(-1)]
