"""The CRC-32 every writer and reader computes (trace/crc.py) is zlib's, whichever implementation
computes it: isal's faster one, where installed, gives the same value for every length, alignment,
continuation and buffer kind a trace's bytes come in."""

from __future__ import annotations

import mmap
import zlib

import numpy as np

from tracediff.trace import crc


def test_isal_is_the_implementation_in_the_test_environment() -> None:
    assert crc.IMPLEMENTATION == "isal"  # a dependency on this platform: the benchmarks measure it


def test_the_values_are_zlibs(tmp_path) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "bytes"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        for start, stop in ((0, 0), (0, 1), (3, 10), (1, 4097), (5, 65541), (0, 1 << 20), (777, 1 << 20)):
            piece = data[start:stop]
            for value in (0, 1, 0xFFFFFFFF, 0x12345678):
                want = zlib.crc32(piece.tobytes(), value)
                assert crc.crc32(piece.data, value) == want  # numpy buffer, unaligned starts
                assert crc.crc32(view[start:stop], value) == want  # the file's mapping
                assert crc.crc32(piece.tobytes(), value) == want
        view.release()
    halves = crc.crc32(data[1000:].data, crc.crc32(data[:1000].data))
    assert halves == zlib.crc32(data.tobytes())  # continued in pieces, as windows are
