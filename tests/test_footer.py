"""An Arrow file's footer read by hand: the record batch blocks pyarrow reads, nothing from bytes
that are not a footer; and opening a trace asks the disk, at once, for every byte its key reads
will touch."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

import tracediff as td
from tracediff.trace import arrow
from tracediff.trace.footer import FOOTER_TAIL, Block, file_blocks, footer_length, record_batch_blocks


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A closed Arrow trace of 4 batches of unequal records."""
    path = tmp_path_factory.mktemp("footer") / "t.arrow"
    with td.record(path, source="training") as rec:
        for step in range(4):
            for name, width in (("draft.hidden", 64 + step), ("draft.logits", 300)):
                rec.log(name, np.full((3 + step, width), step, np.float32), step=step,
                        token_ids=np.arange(3 + step), request=f"r{step % 2}")
            rec.flush()
    return path


def footer_of(data: bytes) -> bytes:
    length = footer_length(data[-FOOTER_TAIL:])
    assert length is not None
    return data[-FOOTER_TAIL - length : -FOOTER_TAIL]


def test_the_blocks_are_the_batches_pyarrow_reads(trace) -> None:
    data = trace.read_bytes()
    blocks = record_batch_blocks(footer_of(data), len(data))
    assert len(blocks) == pa.ipc.open_file(trace).num_record_batches >= 5  # 4 flushes + the index's
    for block in blocks:
        message = pa.ipc.read_message(pa.BufferReader(data[block.offset : block.end]))
        assert message.type == "record batch"
        assert message.body.size == block.body
        assert len(message.metadata) <= block.meta
    assert all(a.end <= b.offset for a, b in zip(blocks, blocks[1:]))


def test_bytes_that_are_not_a_footer_give_no_blocks(trace) -> None:
    data = trace.read_bytes()
    footer = footer_of(data)
    assert footer_length(b"x" * FOOTER_TAIL) is None
    assert footer_length(b"\xff\xff\xff\xffARROW1") is None  # a negative length
    assert record_batch_blocks(b"", len(data)) == []
    assert record_batch_blocks(footer, 100) == []  # blocks past the file's end
    rng = random.Random(0)
    for cut in range(0, len(footer), 7):  # a cut footer parses to nothing or to blocks in the file
        for blocks in (record_batch_blocks(footer[:cut], len(data)),
                       record_batch_blocks(bytes(rng.randrange(256) for _ in range(cut)), len(data))):
            assert all(isinstance(b, Block) and 0 <= b.offset <= b.end <= len(data) for b in blocks)
    for at in range(len(footer)):  # one corrupt byte never raises
        flipped = bytearray(footer)
        flipped[at] ^= 0xFF
        record_batch_blocks(bytes(flipped), len(data))


def test_a_file_gives_its_footers_blocks_and_none_when_cut_or_foreign(trace, tmp_path) -> None:
    data = trace.read_bytes()
    with open(trace, "rb") as f:
        assert file_blocks(f.fileno(), len(data)) == record_batch_blocks(footer_of(data), len(data))
    for name, content in (("cut.arrow", data[: len(data) - 3]), ("short.arrow", data[:5]),
                          ("foreign.arrow", b"PK\x03\x04" + bytes(64)), ("empty.arrow", b"")):
        (tmp_path / name).write_bytes(content)
        with open(tmp_path / name, "rb") as f:
            assert file_blocks(f.fileno(), len(content)) == [], name


def test_opening_asks_for_every_byte_the_key_reads_touch(trace, monkeypatch) -> None:
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(arrow, "prefetch", lambda fd, offset, length: asked.append((offset, length)))
    with td.open_trace(trace) as opened:
        assert asked  # at open, before any key is read
        opened_keys = len(asked)
        for slot in range(len(opened.index)):
            opened.files[0].read_keys_many(np.array([slot]))
        assert len(asked) == opened_keys
    source = pa.memory_map(str(trace))
    base = source.read_buffer(1).address
    reader = pa.ipc.open_file(source)
    covered = np.zeros(trace.stat().st_size, dtype=bool)
    for offset, length in asked:
        covered[offset : offset + length] = True
    for b in range(reader.num_record_batches - 1):  # the last batch, the index's, is read at open
        batch = reader.get_batch(b)
        for name in batch.schema.names:
            buffers = batch.column(name).buffers()
            if name == "data":
                buffers = buffers[:-1]  # its tensor bytes are the compare's to read, not the keys'
            for buffer in filter(None, buffers):
                at = buffer.address - base
                assert covered[at : at + buffer.size].all(), (b, name)
