"""Turning what a caller passes to ``log`` into one (request, position, token_id) per row.

A tensor's leading dims must equal the shape of ``token_ids``: ``[T, ...]`` with ``[T]`` ids, or
``[B, T, ...]`` with ``[B, T]`` ids (HF style); those dims are flattened into the row axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tracediff.record.host import HostCopy, is_torch_tensor, to_int64


@dataclass
class RowContext:
    """Row keys set once per forward, used by hooks and by ``log`` calls that omit them."""

    step: int = 0
    depth: int = 0
    request: Any = None
    positions: Any = None
    token_ids: Any = None


@dataclass
class RowKeys:
    n_rows: int
    lead_ndim: int
    request: np.ndarray
    position: np.ndarray | HostCopy
    token_id: np.ndarray | HostCopy


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _keys_copy(x: Any) -> np.ndarray | HostCopy:
    return HostCopy(x) if is_torch_tensor(x) else to_int64(x).reshape(-1)


def resolve_rows(tensor_shape: Sequence[int], step: int, token_ids: Any, positions: Any = None,
                 request: Any = None) -> RowKeys:
    """Validate and expand row keys; raises ValueError naming what does not fit."""
    if token_ids is None:
        raise ValueError("token_ids are required for a per-token tensor (or use log_static)")
    lead = _shape(token_ids)
    if len(lead) not in (1, 2):
        raise ValueError(f"token_ids must be [T] or [B, T], got shape {lead}")
    if tuple(tensor_shape[: len(lead)]) != lead:
        raise ValueError(f"tensor leading dims {tuple(tensor_shape)} do not match token_ids {lead}")
    n_rows = int(np.prod(lead))
    if positions is None:
        arange = np.arange(lead[-1], dtype=np.int64)
        position: np.ndarray | HostCopy = np.broadcast_to(arange, lead).reshape(-1)
    else:
        if _shape(positions) != lead:
            raise ValueError(f"positions shape {_shape(positions)} does not match token_ids {lead}")
        position = _keys_copy(positions)
    batch = lead[0] if len(lead) == 2 else 1
    return RowKeys(n_rows=n_rows, lead_ndim=len(lead), request=_requests(request, step, batch, n_rows),
                   position=position, token_id=_keys_copy(token_ids))


def _requests(request: Any, step: int, batch: int, n_rows: int) -> np.ndarray:
    """One id per row: a single id, one per batch row, or one per row; default ``s{step}b{row}``."""
    if request is None:
        ids = np.array([f"s{step}b{b}" for b in range(batch)], dtype=object)
    elif isinstance(request, (str, int)):
        return np.full(n_rows, str(request), dtype=object)
    else:
        ids = np.array([str(r) for r in request], dtype=object)
    if len(ids) == n_rows:
        return ids
    if len(ids) == batch:
        return np.repeat(ids, n_rows // batch)
    raise ValueError(f"{len(ids)} request ids for {batch} batch rows and {n_rows} rows")
