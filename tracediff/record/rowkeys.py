"""Turning what a caller passes to ``log`` into one (request, position, token_id) per row.

A tensor's leading dims must equal the shape of ``token_ids``: ``[T, ...]`` with ``[T]`` ids, or
``[B, T, ...]`` with ``[B, T]`` ids (HF style); those dims are flattened into the row axis. An
``attention_mask`` shaped like the ids marks padding (0): padded rows get position -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from tracediff.record.copies import HostCopy, is_torch_tensor, to_int64

PADDING = -1  # the position of a padded row


@dataclass
class RowContext:
    """Row keys set once per forward, used by hooks and by ``log`` calls that omit them."""

    step: int = 0
    depth: int = 0
    request: Any = None
    positions: Any = None
    token_ids: Any = None
    attention_mask: Any = None


@dataclass(slots=True)
class LogRowKeys:
    """Row keys as the caller gave them, checked but not yet expanded: expanding one id per row
    costs the host more than the check, so the writer thread does it. Slotted: one is queued per
    ``log`` call, and its size counts against the queue's bound."""

    n_rows: int
    lead_ndim: int
    batch: int
    request_ids: np.ndarray  # one id, one per batch row, or one per row
    position: np.ndarray | HostCopy | None  # None: 0..T-1 along the token axis
    token_id: np.ndarray | HostCopy
    mask: np.ndarray | HostCopy | None = None  # attention mask, 0 = padding
    lead: tuple[int, ...] = ()  # the leading dims of a tensor cut along them: ``[T]`` or ``[B, T]``
    step: int | None = None  # the step ``Recorder.row_keys`` made them for (their records' default)
    refused: str | None = None  # why records cut along these keys are refused (``Recorder.row_keys``)
    learned_by: int = 0  # serial of the recorder whose token book knows them (keys shared by records)
    _expanded: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _id_bytes: int = field(default=-1, repr=False)  # id_bytes, once computed (the queue and the cost ask)

    def id_bytes(self) -> int:
        """Host memory the request ids hold, by their real length (each a str object); computed once."""
        if self._id_bytes < 0:
            self._id_bytes = sum(56 + len(r) for r in self.request_ids)
        return self._id_bytes

    def requests(self) -> np.ndarray:
        """One request id per row."""
        if not self.n_rows:  # no row (an empty batch gives no id either)
            return np.zeros(0, dtype=object)
        return np.repeat(self.request_ids, self.n_rows // len(self.request_ids))

    def positions(self) -> np.ndarray:
        """One position per row; padded rows (mask 0, or given as -1) are -1. Without positions,
        real rows count from 0 along the token axis, skipping padding (HF's cumsum(mask) - 1)."""
        if not self.n_rows:
            return np.zeros(0, dtype=np.int64)
        per_row = self.n_rows // self.batch
        if self.mask is None:
            if self.position is None:
                return np.tile(np.arange(per_row, dtype=np.int64), self.batch)
            return _host_int64(self.position)
        real = _host_int64(self.mask) != 0
        if self.position is None:
            counted = np.cumsum(real.reshape(self.batch, per_row), axis=1, dtype=np.int64) - 1
            return np.where(real, counted.reshape(-1), PADDING)
        return np.where(real, _host_int64(self.position), PADDING)

    def token_ids(self) -> np.ndarray:
        return _host_int64(self.token_id)

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) per row, computed once: the writer may need them twice
        (the record and the token table)."""
        if self._expanded is None:
            self._expanded = (self.requests(), self.positions(), self.token_ids())
        return self._expanded


def _host_int64(x: np.ndarray | HostCopy) -> np.ndarray:
    return x.numpy().astype(np.int64, copy=False).reshape(-1) if isinstance(x, HostCopy) else x


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _keys_copy(x: Any) -> np.ndarray | HostCopy:
    return HostCopy(x) if is_torch_tensor(x) else to_int64(x).reshape(-1)


def resolve_keys(step: int, token_ids: Any, positions: Any = None, request: Any = None,
                 attention_mask: Any = None) -> LogRowKeys:
    """Validate row keys among themselves (not against a tensor); raises ValueError naming what
    does not fit."""
    if token_ids is None:
        raise ValueError("token_ids are required for a per-token tensor (or use log_static)")
    lead = _shape(token_ids)
    if len(lead) not in (1, 2):
        raise ValueError(f"token_ids must be [T] or [B, T], got shape {lead}")
    for what, value in (("positions", positions), ("attention_mask", attention_mask)):
        if value is not None and _shape(value) != lead:
            raise ValueError(f"{what} shape {_shape(value)} does not match token_ids {lead}")
    n_rows = int(np.prod(lead))
    batch = lead[0] if len(lead) == 2 else 1
    return LogRowKeys(n_rows=n_rows, lead_ndim=len(lead), batch=batch, lead=tuple(int(n) for n in lead),
                      request_ids=_request_ids(request, step, batch, n_rows),
                      position=None if positions is None else _keys_copy(positions),
                      token_id=_keys_copy(token_ids),
                      mask=None if attention_mask is None else _keys_copy(attention_mask))


def resolve_rows(tensor_shape: Sequence[int], step: int, token_ids: Any, positions: Any = None,
                 request: Any = None, attention_mask: Any = None) -> LogRowKeys:
    """Validate row keys against the tensor; raises ValueError naming what does not fit."""
    lead = _shape(token_ids) if token_ids is not None else ()
    if token_ids is not None and len(lead) in (1, 2) and tuple(tensor_shape[: len(lead)]) != lead:
        raise ValueError(f"tensor leading dims {tuple(tensor_shape)} do not match token_ids {lead}")
    return resolve_keys(step, token_ids, positions, request, attention_mask)


def sequence_keys(request: Any, token_ids: Any, start: int) -> LogRowKeys:
    """Keys of a request's tokens declared as one sequence starting at position ``start``."""
    ids = to_int64(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"request_tokens takes a 1-D token list, got shape {ids.shape}")
    if int(start) < 0:
        raise ValueError(f"request_tokens start must be >= 0, got {start}")
    return LogRowKeys(n_rows=len(ids), lead_ndim=1, batch=1, lead=(len(ids),),
                      request_ids=np.array([str(request)], dtype=object),
                      position=np.arange(int(start), int(start) + len(ids), dtype=np.int64), token_id=ids)


def _one_id(request: Any) -> str:
    """One id as text; bytes are refused (str() of them reads b'...', iterating them gives ints)."""
    if isinstance(request, (bytes, bytearray, memoryview)):
        raise TypeError(f"a request id is text (str), not {type(request).__name__}")
    return str(request)


def _request_ids(request: Any, step: int, batch: int, n_rows: int) -> np.ndarray:
    """A single id, one per batch row, or one per row; default ``s{step}b{row}``."""
    if request is None:
        return np.array([f"s{step}b{b}" for b in range(batch)], dtype=object)
    if isinstance(request, (str, int, np.integer)):
        return np.array([str(request)], dtype=object)
    if isinstance(request, (bytes, bytearray, memoryview)):
        raise TypeError(f"a request id is text (str), not {type(request).__name__}")
    given = request.tolist() if isinstance(request, np.ndarray) else list(request)
    try:  # one id per request, not per row
        ids = np.array([*map({r: _one_id(r) for r in set(given)}.__getitem__, given)], dtype=object)
    except TypeError:  # an unhashable id: read row by row (its str() is the id)
        ids = np.array([_one_id(r) for r in given], dtype=object)
    if len(ids) not in (batch, n_rows):
        raise ValueError(f"{len(ids)} request ids for {batch} batch rows and {n_rows} rows")
    return ids
