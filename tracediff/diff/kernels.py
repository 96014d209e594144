"""Compiled row kernels: ``kernels.c`` built with the machine's C compiler on first use and loaded
through ctypes; every per-row metric of two rows in one streaming pass, rows split across threads.
``numpy_kernels`` computes the same tables where no compiler is to be had.

Why C through ctypes: loading the built library takes about a millisecond and needs nothing beyond
the standard library, where numba's import and first dispatch took ~0.5 s of every large compare
(and its first compile 10-20 s per machine; ``cc`` builds this file in about a second). Every
serving and training machine this tool runs on has a compiler: Triton, which SGLang and torch
use, compiles its launchers with it. ctypes lets go of the GIL for the whole call, so the
read-ahead thread and the kernels' threads run together.

The library is cached under ``cache_dir()`` (a folder only this user can write to, else one in
the temp dir) in a file named by a hash of the source, the flags, the compiler's version and the
CPU's features (``-march=native`` code never runs on another CPU that shares the cache, e.g. a
home directory on NFS); it is written under a temporary name and renamed, so concurrent first
uses each see a whole library. A build that fails (no compiler, a read-only
cache and temp dir) is tried once per process; ``available()`` is then False and the engine measures
with numpy. How the kernels argue their correctness (block sums, the overflow-safe rescaling, the
one-pass top-k and KL) is written at the top of ``kernels.c``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from tracediff.diff.numpy_kernels import COLUMNS as COLUMNS  # the table's columns, for callers
from tracediff.diff.numpy_kernels import F64_RANGE

SOURCE = Path(__file__).with_name("kernels.c")
# Reassociation and contraction (what vectorized sums need), never finite-math: NaN and Inf keep
# their IEEE meaning.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math", "-ffp-contract=fast")
# float32 sums are trusted for rows whose largest magnitude lies in this range (or is 0): squares
# and squared differences of such values stay normal floats, far from overflow.
F32_RANGE = (1e-6, 1e15)
TOP_BLOCK = 64  # elements per block maximum in the top-k search (kernels.c's TOP_BLOCK)
MAX_K = 64  # the largest top-k the kernels take (kernels.c's MAX_K)
BUILD_SECONDS = 120  # a compiler that hangs is given up on


def _exp2_polynomial(degree: int = 5) -> tuple[float, ...]:
    """Coefficients (lowest first) of a polynomial near 2**f on [-1/2, 1/2] in relative error: a
    weighted least-squares fit on Chebyshev nodes, within 2.2e-7 evaluated in float32."""
    nodes = 0.5 * np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    coefficients = np.polynomial.polynomial.polyfit(nodes, 2.0**nodes, degree, w=2.0**-nodes)
    return tuple(float(np.float32(c)) for c in coefficients)


PARAMS = np.array([*F32_RANGE, *F64_RANGE, *_exp2_polynomial()], dtype=np.float64)
_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # empty: not tried yet; [None]: no library in this process


def cache_dir() -> Path:
    """Where built libraries are kept: ``$TRACEDIFF_CACHE``, else ``$XDG_CACHE_HOME/tracediff``,
    else ``~/.cache/tracediff``."""
    if os.environ.get("TRACEDIFF_CACHE"):
        return Path(os.environ["TRACEDIFF_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tracediff"


def compiler() -> str | None:
    """The C compiler: ``$CC``, else the first of cc, gcc, clang on the PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), for the cache key; the machine's name elsewhere."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def _build(cc: str) -> Path:
    """The library for this source, compiler and CPU: from the cache, or built into it now."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=BUILD_SECONDS).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_features()]).encode())
    name = f"kernels-{key.hexdigest()[:16]}{'.dll' if sys.platform == 'win32' else '.so'}"
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"tracediff-{os.getuid()}"):
        target = folder / name
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(folder):
                continue  # another user could have put a library there: never loaded
            if target.is_file():
                return target
            fd, partial = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
            os.close(fd)
        except OSError:
            continue  # not writable: the next folder
        try:
            subprocess.run([cc, *FLAGS, "-o", partial, str(SOURCE)], check=True, capture_output=True,
                           timeout=BUILD_SECONDS)
            os.replace(partial, target)
            return target
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    raise OSError("no writable folder for the compiled kernels")


def _private(folder: Path) -> bool:
    """Whether only this user can put files into ``folder``: owned by them, writable by no one else."""
    info = folder.stat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first if need be; None where they cannot be (tried once)."""
    with _lock:
        if not _library:
            _library.append(_load())
        return _library[0]


def _load() -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError):
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.td_compare.argtypes = [pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int, size,
                               pointer, pointer, pointer, size]
    lib.td_compare.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the compiled kernels can be used here (builds them on the first call)."""
    return library() is not None


def threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _itemsize(x: np.ndarray) -> int:
    if x.dtype == np.uint16:
        return 2
    if x.dtype in (np.float32, np.float64):
        return x.dtype.itemsize
    raise TypeError(f"rows of {x.dtype} (uint16 bfloat16 bits, float32 or float64 only)")


def _run(base_a: np.ndarray, at_a: np.ndarray | None, base_b: np.ndarray, at_b: np.ndarray | None, n: int,
         width: int, itemsize: int, logits: bool, k: int) -> np.ndarray:
    lib = library()
    if lib is None:
        raise RuntimeError("the compiled kernels are not available here (see kernels.available())")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"top-k must lie within 1..{MAX_K}, got {k}")
    out = np.full((n, 8), np.nan)
    workers = max(1, min(threads(), n))
    scratch = np.empty(workers * 2 * (width // TOP_BLOCK + 1))
    offsets = [None if at is None else np.ascontiguousarray(at, dtype=np.int64) for at in (at_a, at_b)]
    lib.td_compare(base_a.ctypes.data, None if offsets[0] is None else offsets[0].ctypes.data,
                   base_b.ctypes.data, None if offsets[1] is None else offsets[1].ctypes.data,
                   n, width, itemsize, int(logits), k, PARAMS.ctypes.data, scratch.ctypes.data,
                   out.ctypes.data, workers)
    return out


def compare_rows(a: np.ndarray, b: np.ndarray, logits: bool, k: int) -> np.ndarray:
    """[n, 8] float64, columns as ``COLUMNS`` (the last three only when ``logits``), of two 2-D
    arrays of one dtype: uint16 (bfloat16 bit patterns), float32 or float64."""
    if a.dtype != b.dtype or a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"two 2-D arrays of one dtype and shape, got {a.dtype}{a.shape}, {b.dtype}{b.shape}")
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return _run(a, None, b, None, a.shape[0], a.shape[1], _itemsize(a), logits, k)


def compare_mapped(file_a: np.ndarray, at_a: np.ndarray, file_b: np.ndarray, at_b: np.ndarray,
                   width: int, itemsize: int, logits: bool, k: int) -> np.ndarray:
    """``compare_rows`` of rows read in place from two memory-mapped files (uint8), row i starting
    at byte at_a[i] / at_b[i] (any alignment): bfloat16 (``itemsize`` 2) or float32 (4) elements,
    no copy of the data out of the page cache. Offsets are checked against the files' sizes."""
    size = itemsize * width
    for file, at in ((file_a, at_a), (file_b, at_b)):
        if len(at) and (int(at.min()) < 0 or int(at.max()) + size > file.size):
            raise ValueError(f"a row at offsets {int(at.min())}..{int(at.max())} lies outside a file of "
                             f"{file.size} bytes")
    if len(at_a) != len(at_b):
        raise ValueError(f"{len(at_a)} rows on one side, {len(at_b)} on the other")
    return _run(file_a, at_a, file_b, at_b, len(at_a), width, itemsize, logits, k)
