"""CRC-32 of trace bytes: one function every writer and reader calls.

The values are zlib's CRC-32 (the checksum docs/FORMAT.md names); ``isal``'s implementation gives
the same values about 3.5x faster and is used where it is installed, zlib's everywhere else.
"""

from __future__ import annotations

import zlib
from typing import Callable

# crc32(data, value=0): the CRC-32 of a buffer, continuing ``value``. Both implementations let go
# of the GIL over large buffers, so a second thread can checksum while the first computes.
crc32: Callable[..., int] = zlib.crc32
IMPLEMENTATION = "zlib"  # which one computes them, for the benchmarks
try:  # an optional speed-up; identical values (tests/test_crc.py holds the two equal)
    from isal import isal_zlib

    crc32 = isal_zlib.crc32
    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - platforms without an isal wheel
    pass
