"""The two metric engines: numpy (no build step, for small compares) and compiled (C) give the
same numbers on every dtype, width and corner case, in place or copied; the numpy engine never
loads the compiled library, a machine without a compiler measures with numpy, and the engine is
chosen by the bytes a compare measures."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tracediff.diff import numpy_kernels
from tracediff.diff.metrics import COMPILE_BYTES, COMPILED, NUMPY, engine_for
from tracediff.diff.pair import Pair

TAGS = ("float32", "float16", "bfloat16", "float64")
EXACT = ("argmax_agree", "topk_overlap")


def stored(values: np.ndarray, tag: str) -> np.ndarray:
    """Values as a trace stores them: bfloat16 as uint16 bits rounded to nearest even."""
    if tag != "bfloat16":
        with np.errstate(over="ignore"):  # huge values overflow float16 to Inf: a corner too
            return values.astype(tag)
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)  # rounding must not turn NaN into Inf


def corner_rows(width: int, tag: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random rows plus every corner the kernels treat apart, one per row."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((24, width)) * 3
    b = a + rng.standard_normal((24, width)) * np.linspace(0, 1, 24)[:, None]
    b[0] = a[0]  # identical
    huge = 1e4 if tag == "float16" else 1e25  # squares beyond float32 (float16: near its own limit)
    a[1], b[1] = a[1] * 1e-12, b[1] * 1e-12  # squares below float32's normal range
    a[2], b[2] = a[2] * huge, b[2] * huge
    b[3, -1] = np.nan
    a[4, 0] = np.inf  # on one side only: the row is NaN
    a[5, width // 2] = b[5, width // 2] = np.inf  # the same infinity both sides agrees
    a[6, : min(3, width)] = b[6, : min(3, width)] = -np.inf  # masked logits, fewer finite than top-k
    a[7], b[7] = 1.0, 1.0  # every value tied
    a[8, ::2] = b[8, 1::2] = 9.0  # tied maxima, at other places on each side
    a[9], b[9] = 0.0, b[9] * 1e-3  # nothing to be relative to
    b[10] = -a[10]
    b[11] = a[11] * 2  # cosine exactly 1
    a[12, 0], b[12, 0] = -np.inf, np.inf
    a[13, -1] = b[13, -1] = a[13].max() + 5  # the largest value in the last (partial) block
    a[14], b[14] = np.round(a[14]), np.round(b[14])  # many ties across the k-th place
    b[15] = a[15] * (1 + 1e-6 * rng.standard_normal(width))  # KL near 0: rounding must not make it < 0
    if tag == "float64":  # squares that overflow (1e300) or vanish (1e-300) in float64 too: scaled
        a[16], b[16] = a[16] * 1e300, b[16] * 1e300
        a[17], b[17] = a[17] * 1e-300, b[17] * 1e-300
        a[18] = b[18] = a[18] * 1e300
    return stored(a, tag), stored(b, tag)


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """NaN in the same rows; agreement metrics equal; sums to 1e-6 relative, cosine to 4e-6, KL to
    1e-5. The kernels sum bfloat16 in float32 blocks: each sum's rounding error grows as sqrt(n)
    ulps of float32 (a random walk; n <= 4096 here: 64 * 2**-24 = 3.8e-6), and a cosine near 0 is a
    cancelling sum, so its error is absolute, not relative (2e-7 held by luck of the summation order
    on one CPU and failed on another: -0.0165518 vs -0.0165516 at width 257)."""
    assert got.keys() == want.keys()
    for name, expected in want.items():
        assert np.array_equal(np.isnan(got[name]), np.isnan(expected)), name
        if name in EXACT:
            assert np.array_equal(got[name], expected, equal_nan=True), name
        elif name == "kl":
            np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)
        elif name == "cosine":
            np.testing.assert_allclose(got[name], expected, rtol=0, atol=4e-6, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], expected, rtol=1e-6, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("width", [1, 5, 257, 4096])
@pytest.mark.parametrize("tag", TAGS)
def test_numpy_engine_matches_compiled_rows(tag, width) -> None:
    raw_a, raw_b = corner_rows(width, tag)
    for name in ("x.hidden", "x.logits"):
        want = COMPILED.measure_rows(name, (tag, tag), raw_a, raw_b)
        got = NUMPY.measure_rows(name, (tag, tag), raw_a, raw_b)
        assert_same(got, want)
    assert np.isnan(got["max_abs"][[3, 4, 12]]).all() and np.isfinite(got["max_abs"][[5, 6]]).all()
    if tag == "float64":
        assert np.isfinite(got["cosine"][16:19]).all() and got["max_abs"][18] == 0 and got["cosine"][18] == 1
    assert got["cosine"][11] == pytest.approx(1.0, abs=1e-12) and got["kl"][0] == 0.0
    assert (got["kl"][np.isfinite(got["kl"])] >= 0).all() and (want["kl"][np.isfinite(want["kl"])] >= 0).all()


@pytest.mark.parametrize("tags", [("float32", "bfloat16"), ("float64", "float16"), ("bfloat16", "float32")])
def test_mixed_dtypes_match(tags) -> None:
    raw_a, _ = corner_rows(300, tags[0], seed=1)
    _, raw_b = corner_rows(300, tags[1], seed=1)
    assert_same(NUMPY.measure_rows("x.logits", tags, raw_a, raw_b),
                COMPILED.measure_rows("x.logits", tags, raw_a, raw_b))


def test_top_k_ties_and_masked_logits_follow_a_stable_sort() -> None:
    """Top-5 as the first five of a stable descending sort: ties go to the earlier index, and -inf
    is a value like any other (a row masked down to fewer than five finite logits)."""
    inf = np.inf
    a = np.array([[1, 2, -inf, -inf, 3, -inf], [-inf] * 6, [2, 2, 2, 2, 2, 2], [5, 1, 1, 1, 1, 1],
                  [0, 1, 2, 3, 4, 5]], np.float32)
    b = np.array([[1, 2, -inf, -inf, 3, -inf], [-inf] * 6, [1, 2, 2, 2, 2, 2], [5, 1, 1, 1, 1, 0],
                  [5, 4, 3, 2, 1, 0]], np.float32)
    top = [[set(np.argsort(-row, kind="stable")[:5].tolist()) for row in x] for x in (a, b)]
    want = [len(x & y) / 5 for x, y in zip(*top)]
    for engine in (NUMPY, COMPILED):
        got = engine.float_metrics(a, b, logits=True)
        assert got["topk_overlap"].tolist() == want, engine.name
        assert got["argmax_agree"].tolist() == [1, 1, 0, 1, 0], engine.name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("width", [1, 5, 257, 4096])
def test_mapped_rows_match_copied_rows(tmp_path, width, dtype) -> None:
    """Rows read in place from a file at any byte offset, odd ones included, measure as the same
    rows copied out: bfloat16 bit patterns and float32 values."""
    raw_a, raw_b = corner_rows(width, dtype, seed=2)
    stored = np.dtype("<u2") if dtype == "bfloat16" else np.dtype("<f4")
    n, size = len(raw_a), stored.itemsize * width
    gap = 3  # bytes between rows: odd offsets
    at = Pair(np.arange(n, dtype=np.int64) * (size + gap) + 1,
              np.arange(n, dtype=np.int64)[::-1] * (size + gap) + 5)  # rows of b stored in reverse
    files = {}
    for side, raw, offsets in (("a", raw_a, at.a), ("b", raw_b, at.b)):
        image = np.zeros(int(offsets.max()) + size + 7, np.uint8)
        for row, start in zip(raw, offsets):
            image[start : start + size] = row.astype(stored).view(np.uint8)
        (tmp_path / side).write_bytes(image.tobytes())
        files[side] = np.memmap(tmp_path / side, dtype=np.uint8, mode="r")
    mapped = Pair(files["a"], files["b"])
    for name in ("x.hidden", "x.logits"):
        copied = NUMPY.measure_rows(name, (dtype, dtype), raw_a, raw_b)
        assert_same(NUMPY.measure_mapped(name, mapped, at, width, dtype), copied)
        assert_same(COMPILED.measure_mapped(name, mapped, at, width, dtype), copied)


def test_empty_inputs_match() -> None:
    for rows, width in ((0, 8), (3, 0)):
        a = np.zeros((rows, width), np.float32)
        assert_same(NUMPY.float_metrics(a, a, logits=True), COMPILED.float_metrics(a, a, logits=True))


def test_the_engine_follows_the_bytes_to_compare() -> None:
    assert engine_for(0) is NUMPY and engine_for(COMPILE_BYTES - 1) is NUMPY
    assert engine_for(COMPILE_BYTES) is COMPILED and engine_for(64 * COMPILE_BYTES) is COMPILED


@pytest.mark.subprocess
def test_metrics_never_load_the_compiled_kernels_unless_compiled() -> None:
    """Small compares and diagnoses (module functions, the numpy engine) never build or load the
    compiled kernels (a fresh process: the library is loaded once per process)."""
    script = """if True:
        import sys
        import numpy as np
        import tracediff.diff.metrics as m
        from tracediff.diff.pair import Pair
        raw = np.arange(12, dtype=np.uint16).reshape(3, 4)
        m.float_metrics(raw.astype(np.float32), raw.astype(np.float32), logits=True)
        m.metrics_for("x.logits", ("float32", "float32"), raw.astype(np.float32), raw.astype(np.float32))
        m.measure_rows("x", ("bfloat16", "bfloat16"), raw, raw)
        half = raw.view(np.float16)
        m.engine_for(1000).measure_rows("x", ("float16", "float16"), half, half)
        file = raw.view(np.uint8).ravel()
        m.measure_mapped("x", Pair(file, file), Pair(np.array([0, 8]), np.array([8, 16])), 4)
        assert "tracediff.diff.kernels" not in sys.modules, "numpy engine"
        m.engine_for(m.COMPILE_BYTES).measure_rows("x", ("float32", "float32"), raw.astype(np.float32),
                                                   raw.astype(np.float32))
        from tracediff.diff import kernels
        assert kernels._library and kernels._library[0] is not None, "compiled engine"
    """
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_no_compiler_measures_with_numpy(tmp_path, monkeypatch) -> None:
    """Where the kernels cannot be built (no compiler), the compiled engine gives numpy's numbers."""
    from tracediff.diff import kernels

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TRACEDIFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_library", [])
    assert not kernels.available()
    assert COMPILED.kernels() is numpy_kernels
    raw_a, raw_b = corner_rows(33, "float32")
    assert_same(COMPILED.measure_rows("x.logits", ("float32", "float32"), raw_a, raw_b),
                NUMPY.measure_rows("x.logits", ("float32", "float32"), raw_a, raw_b))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_the_library_is_built_once_into_the_cache(tmp_path, monkeypatch) -> None:
    """A first use builds the library into the cache folder (whole, under its final name only);
    the next process finds it there and builds nothing."""
    from tracediff.diff import kernels

    monkeypatch.setenv("TRACEDIFF_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_library", [])
    assert kernels.available()
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("kernels-") and built[0].endswith(".so")
    stamp = (tmp_path / built[0]).stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_library", [])
    assert kernels.available() and (tmp_path / built[0]).stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == built


def test_a_cache_others_can_write_to_is_never_used(tmp_path, monkeypatch) -> None:
    """A library planted in a group- or world-writable cache folder is never loaded: the kernels
    are built in this user's own folder in the temp dir instead."""
    from tracediff.diff import kernels

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TRACEDIFF_CACHE", str(shared))
    monkeypatch.setattr(kernels, "_library", [])
    assert kernels.available()
    assert list(shared.iterdir()) == []
    assert kernels._library[0] is not None and not str(kernels._library[0]._name).startswith(str(shared))
