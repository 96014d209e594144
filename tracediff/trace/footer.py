"""Where an Arrow IPC file's record batches lie, read from its footer by hand (pyarrow does not
say): one ``Block`` per batch, for read-ahead hints only. Bytes that do not parse as a footer
give no blocks; nothing here is trusted for what a trace holds.

The footer is a flatbuffer ending 10 bytes before the file does (its int32 length, then
``ARROW1``). Its root table's field 3 is the vector of record batch blocks, each a 24-byte
struct: int64 offset of the batch's message, int32 metadata length, 4 bytes of padding, int64
body length (Arrow's File.fbs). Every offset read is checked against the bytes before it is used.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

FOOTER_END = b"ARROW1"  # an IPC file's last 6 bytes, written after its footer
FOOTER_TAIL = 4 + len(FOOTER_END)  # the footer's int32 length, then FOOTER_END
RECORD_BATCHES_FIELD = 3  # Footer { version, schema, dictionaries, recordBatches, custom_metadata }
BLOCK = struct.Struct("<qi4xq")  # offset, metaDataLength, padding, bodyLength


class Block(NamedTuple):
    """One record batch: its message at ``offset``, ``meta`` bytes of metadata, then ``body`` bytes."""

    offset: int
    meta: int
    body: int

    @property
    def end(self) -> int:
        return self.offset + self.meta + self.body


def footer_length(tail: bytes) -> int | None:
    """The footer's length from a file's last 10 bytes; None unless they end an Arrow file."""
    if len(tail) != FOOTER_TAIL or tail[4:] != FOOTER_END:
        return None
    (length,) = struct.unpack_from("<i", tail)
    return length if length > 0 else None


def file_blocks(fd: int, file_size: int) -> list[Block]:
    """The blocks the footer of the ``file_size``-byte file open at ``fd`` lists; [] where it has
    no footer, or one that does not parse, or it cannot be read."""
    try:
        length = footer_length(os.pread(fd, FOOTER_TAIL, max(0, file_size - FOOTER_TAIL)))
        if length is None or length > file_size - FOOTER_TAIL:
            return []
        footer = os.pread(fd, length, file_size - FOOTER_TAIL - length)
    except OSError:
        return []
    return record_batch_blocks(footer, file_size)


def record_batch_blocks(footer: bytes, file_size: int) -> list[Block]:
    """The blocks a footer's flatbuffer lists, each within a file of ``file_size`` bytes; [] for
    bytes that are not such a footer."""
    try:
        table = _u32(footer, 0)
        vtable = table - _i32(footer, table)
        vtable_size = _u16(footer, vtable)
        slot = 4 + 2 * RECORD_BATCHES_FIELD
        if vtable_size < slot + 2 or vtable_size % 2:
            return []
        field = _u16(footer, vtable + slot)
        if not field:
            return []
        vector = table + field + _u32(footer, table + field)
        count = _u32(footer, vector)
        if vector + 4 + count * BLOCK.size > len(footer):
            return []
        blocks = [Block(*BLOCK.unpack_from(footer, vector + 4 + k * BLOCK.size)) for k in range(count)]
    except (struct.error, IndexError):
        return []
    if any(b.offset < 0 or b.meta < 0 or b.body < 0 or b.end > file_size for b in blocks):
        return []
    return blocks


def _u16(data: bytes, at: int) -> int:
    return _read("<H", data, at)


def _u32(data: bytes, at: int) -> int:
    return _read("<I", data, at)


def _i32(data: bytes, at: int) -> int:
    return _read("<i", data, at)


def _read(fmt: str, data: bytes, at: int) -> int:
    if at < 0:
        raise IndexError(at)
    (value,) = struct.unpack_from(fmt, data, at)
    return int(value)
