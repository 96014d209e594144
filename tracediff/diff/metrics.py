"""Per-row comparison metrics; every function takes two [rows, ...] arrays and returns [rows].

Floats: ``max_abs``, ``mean_abs``, ``rel_l2`` (|a-b| / |a|), ``cosine`` and ``max_rel``
(max|a-b| / max|a|); for logits also ``argmax_agree``, ``topk_overlap`` (top ``TOP_K``) and ``kl``
(KL(a || b) of the softmaxes). Integers: ``equal``. Values are compared, never stored bits: two
sides of other dtypes compare as numbers (floats in the wider float, an integer side against a
float side as float64 values), integers of any widths exactly.

Two engines give the same numbers: ``numpy`` (``numpy_kernels``, nothing to build) and
``compiled`` (``kernels``: C built by the machine's compiler on first use, about a second, then a
library loaded in a millisecond; 3-10x faster). ``engine_for`` picks by the bytes a compare will
measure; the module-level functions use numpy, as they serve small inputs (diagnoses' samples).
The compiled engine measures with numpy where no library can be built (no compiler).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import numpy as np

from tracediff.diff import numpy_kernels
from tracediff.diff.numpy_kernels import COLUMNS
from tracediff.diff.pair import Pair
from tracediff.trace.dtypes import FLOAT_TAGS, decode

TOP_K = 5
# Below this many bytes to measure (both sides together) numpy is used: hidden states measure at
# 0.8-1.7 GB/s in numpy on a 2-core box, bfloat16 logits at ~0.15 GB/s, so below it numpy costs at
# most ~0.4 s more than the compiled kernels, and a small compare (the sample traces) never waits
# for their first build (~1 s).
COMPILE_BYTES = 64 << 20
# Stored dtypes the kernels read in place from a mapped file (the same on both sides): its itemsize.
MAPPED_DTYPES = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Engine:
    """One implementation of the row tables: ``"numpy"`` or ``"compiled"``."""

    name: Literal["numpy", "compiled"]

    def kernels(self) -> ModuleType:
        """The module computing the tables: ``kernels`` for the compiled engine (built on its first
        use) where they can be built, ``numpy_kernels`` otherwise."""
        if self.name == "compiled":
            compiled = importlib.import_module("tracediff.diff.kernels")
            if compiled.available():
                return compiled
        return numpy_kernels

    def float_metrics(self, a: np.ndarray, b: np.ndarray, logits: bool = False) -> dict[str, np.ndarray]:
        """The float metrics of decoded rows (or of two uint16 arrays of bfloat16 bit patterns);
        with ``logits``, the logit metrics too. Rows of integers (or bools) are measured as float64
        values: float32 would round integers above 2^24."""
        if not a.dtype == b.dtype == np.uint16:
            wide = np.float64 if any(x.dtype == np.float64 or x.dtype.kind in "iub" for x in (a, b)) \
                else np.float32
            a, b = a.astype(wide, copy=False), b.astype(wide, copy=False)
        a, b = _flat(a), _flat(b)
        return _named(self.kernels().compare_rows(a, b, logits, _top_k(a.shape[1])), logits)

    def measure_rows(self, name: str, dtypes: tuple[str, str], raw_a: np.ndarray,
                     raw_b: np.ndarray) -> dict[str, np.ndarray]:
        """``metrics_for`` over raw stored rows; bfloat16 on both sides is decoded inside the kernel."""
        if not any(d in FLOAT_TAGS for d in dtypes):
            return token_metrics(raw_a, raw_b)
        logits = name.endswith("logits")
        if dtypes == ("bfloat16", "bfloat16"):
            return self.float_metrics(raw_a, raw_b, logits)
        return self.float_metrics(decode(raw_a, dtypes[0]), decode(raw_b, dtypes[1]), logits)

    def measure_mapped(self, name: str, files: Pair[np.ndarray], at: Pair[np.ndarray], width: int,
                       dtype: str = "bfloat16") -> dict[str, np.ndarray]:
        """``measure_rows`` of rows of ``width`` elements of ``dtype`` (one of ``MAPPED_DTYPES``, both
        sides) read from memory-mapped trace files (uint8) at byte offsets ``at``."""
        logits = name.endswith("logits")
        table = self.kernels().compare_mapped(files.a, at.a, files.b, at.b, width, MAPPED_DTYPES[dtype],
                                              logits, _top_k(width))
        return _named(table, logits)


NUMPY, COMPILED = Engine("numpy"), Engine("compiled")


def engine_for(total_bytes: int) -> Engine:
    """The engine for a compare measuring ``total_bytes`` of stored rows (both sides together):
    numpy below ``COMPILE_BYTES``, where a first build would cost more than it saves; compiled above."""
    return COMPILED if total_bytes >= COMPILE_BYTES else NUMPY


def float_metrics(a: np.ndarray, b: np.ndarray, logits: bool = False) -> dict[str, np.ndarray]:
    """``Engine.float_metrics`` with numpy."""
    return NUMPY.float_metrics(a, b, logits)


def token_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Exact equality per row, for integer tensors (token ids, accept lengths), by value whatever
    the two widths (numpy compares int8 with int64 as numbers)."""
    return {"equal": (_flat(a) == _flat(b)).all(axis=1).astype(np.float64)}


def metrics_for(name: str, dtypes: tuple[str, str], a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """The metrics that fit a tensor, of decoded rows: exact equality when both sides are integers,
    float metrics otherwise (an integer side measured by value against the float one), logit
    metrics too for names ending in ``logits``."""
    if not any(d in FLOAT_TAGS for d in dtypes):
        return token_metrics(a, b)
    return float_metrics(a, b, logits=name.endswith("logits"))


def measure_rows(name: str, dtypes: tuple[str, str], raw_a: np.ndarray,
                 raw_b: np.ndarray) -> dict[str, np.ndarray]:
    """``Engine.measure_rows`` with numpy (large compares use ``engine_for``)."""
    return NUMPY.measure_rows(name, dtypes, raw_a, raw_b)


def measure_mapped(name: str, files: Pair[np.ndarray], at: Pair[np.ndarray], width: int,
                   dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """``Engine.measure_mapped`` with numpy (large compares use ``engine_for``)."""
    return NUMPY.measure_mapped(name, files, at, width, dtype)


def _flat(x: np.ndarray) -> np.ndarray:
    """[rows, elements per row]; also for no rows (``reshape(n, -1)`` refuses size 0)."""
    return np.ascontiguousarray(x.reshape(len(x), int(np.prod(x.shape[1:], dtype=np.int64))))


def _top_k(width: int) -> int:
    return max(1, min(TOP_K, width))


def _named(table: np.ndarray, logits: bool) -> dict[str, np.ndarray]:
    """The engine's [rows, 8] table as metric name -> per-row values."""
    return {column: table[:, i] for i, column in enumerate(COLUMNS[: 8 if logits else 5])}
