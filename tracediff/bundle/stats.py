"""Summary statistics of every tensor of a trace, read record by record in bounded memory (a bundle
keeps these for the tensors its slices leave out)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracediff.trace.dtypes import decode
from tracediff.trace.reader import Trace
from tracediff.trace.summary import TensorStats

CHUNK_VALUES = 1 << 22  # values decoded to float64 at a time (32 MiB)
HEAD = 8


@dataclass
class _Moments:
    """Running count, mean, M2 (Chan et al.'s parallel combination: stable for any length)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    low: float = math.inf
    high: float = -math.inf
    nan: int = 0
    inf: int = 0

    def add(self, values: np.ndarray) -> None:
        with np.errstate(invalid="ignore", over="ignore"):
            flat = values.reshape(-1).astype(np.float64)
            finite = flat[np.isfinite(flat)]
            nan = int(np.isnan(flat).sum())
            self.nan += nan
            self.inf += int(len(flat) - len(finite) - nan)
            if not len(finite):
                return
            n, mean = len(finite), float(finite.mean())
            m2 = float(((finite - mean) ** 2).sum())
            total = self.n + n
            delta = mean - self.mean
            self.m2 += m2 + delta * delta * self.n * n / total
            self.mean += delta * n / total
            self.n = total
            self.low, self.high = min(self.low, float(finite.min())), max(self.high, float(finite.max()))

    def stats(self, name: str, dtype: str, rows: int, shape: list[int], head: list) -> TensorStats:
        known = self.n > 0
        with np.errstate(invalid="ignore", over="ignore"):
            std = math.sqrt(self.m2 / self.n) if known and math.isfinite(self.m2) else math.nan
        return TensorStats(name=name, dtype=dtype, rows=rows, shape=shape,
                           min=self.low if known else math.nan, max=self.high if known else math.nan,
                           mean=self.mean if known else math.nan, std=std, nan=self.nan, inf=self.inf,
                           head=head)


def trace_stats(trace: Trace, names: list[str] | None = None) -> list[TensorStats]:
    """Stats of each tensor (all by default, in execution order) over every row of every record; a
    static tensor's over its last record, as compare reads it. Tensors whose records differ in dtype
    or row shape are left out (they have no single shape)."""
    out = []
    idx = trace.index
    for name in trace.names() if names is None else names:
        hits = trace.select(name=name)
        static = idx.static[hits]
        if static.all():
            hits = hits[-1:]
        elif static.any() or len(set(idx.dtype[hits].tolist())) > 1 \
                or len({idx.shape[i][1:] for i in hits.tolist()}) > 1:
            continue
        moments, head, rows = _Moments(), None, 0
        first = idx.shape[hits[0]]
        shown = min(HEAD, math.prod(first if static.all() else first[1:]))  # of the first row, as show says
        for i in hits.tolist():
            record = trace.read(i)
            flat = record.data.reshape(-1)
            for start in range(0, len(flat), CHUNK_VALUES):
                decoded = decode(flat[start:start + CHUNK_VALUES], record.dtype)
                moments.add(decoded)
                if head is None:
                    head = decoded[:shown].tolist()
            rows += record.n_rows
        shape = list(first) if static.all() else [rows, *first[1:]]
        out.append(moments.stats(name, idx.dtype[hits[0]], rows, shape, head or []))
    return out
