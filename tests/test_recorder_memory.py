"""The recorder's memory stays within its bounds: request ids charged by length, the token table
sparse and bounded (written entries leave memory, a flood is dropped and counted), and the
importers' recorder takes a record larger than its queue."""

from __future__ import annotations

import numpy as np

import tracediff as td
from tracediff.record.queue import LEARN_OVERHEAD, TOKEN_ROW_BYTES
from tracediff.record.rowkeys import resolve_keys
from tracediff.record.tokens import TokenBook


def _rows(request: str, position: int, token: int = 7):
    return (np.array([request], dtype=object), np.array([position], np.int64), np.array([token], np.int64))


def test_request_ids_are_charged_by_their_length() -> None:
    """A 32 KiB id was charged 64 bytes a row (1.6 GB over the bound); now its real length counts."""
    long_ids = [f"r{i}".ljust(32 << 10, "x") for i in range(4)]
    keys = resolve_keys(0, np.ones(4, np.int64), request=long_ids)
    assert keys.id_bytes() >= 4 * (32 << 10)
    short = resolve_keys(0, np.ones(4, np.int64), request=["a", "b", "c", "d"])
    assert keys.id_bytes() - short.id_bytes() >= 4 * ((32 << 10) - 1)
    assert LEARN_OVERHEAD + 4 * TOKEN_ROW_BYTES + keys.id_bytes() > 4 * (32 << 10)


def test_a_row_at_a_far_position_costs_what_a_row_at_zero_does() -> None:
    """Rows at position 16,000,000 allocated the whole dense range (+625 MiB for 40 rows)."""
    far, near = TokenBook(), TokenBook()
    for i in range(40):
        far.learn(*_rows(f"r{i}", 16_000_000))
        near.learn(*_rows(f"r{i}", 0))
    assert far.nbytes == near.nbytes < 40 * 1024
    request, position, token = far.take_new()
    assert list(position) == [16_000_000] * 40 and list(token) == [7] * 40


def test_written_entries_leave_memory_and_the_book_stays_in_its_bound() -> None:
    book = TokenBook(limit=64 << 10)
    taken = 0
    for i in range(20_000):
        book.learn(*_rows(f"request-{i}", 3))
        if i % 10 == 9:
            taken += len(book.take_new()[0])
        assert book.nbytes <= book.limit
    assert taken == 20_000 and book.dropped == 0
    assert book.forgotten > 19_000 and len(book._sequences) < 200


def test_a_flood_of_unwritten_entries_is_dropped_and_counted() -> None:
    book = TokenBook(limit=64 << 10)
    for i in range(5_000):
        book.learn(*_rows(f"request-{i}", i))
    assert book.nbytes <= book.limit
    assert book.dropped > 0 and book.dropped + len(book.take_new()[0]) == 5_000


def test_a_request_keeps_its_tokens_and_conflicts_in_sparse_form() -> None:
    book = TokenBook()
    book.learn(np.array(["r"] * 3, dtype=object), np.array([9, 2, 5]), np.array([90, 20, 50]))
    book.learn(np.array(["r"] * 2, dtype=object), np.array([5, 7]), np.array([51, 70]))
    request, position, token = book.take_new()
    assert list(position) == [2, 5, 7, 9] and list(token) == [20, 50, 70, 90]
    assert book.conflicts == 1


def test_the_importers_recorder_writes_a_record_larger_than_its_queue(tmp_path) -> None:
    """A 600-token fp32 logits row over a 128,256 vocab (307 MB) ended in 'the trace was not
    written whole' under the default bound; here the same shape of problem at a 1 MiB bound."""
    path = tmp_path / "t.h5"
    big = np.arange(600 * 2048, dtype=np.float32).reshape(600, 2048)  # 4.9 MB
    with td.record(path, queue_bytes=1 << 20, on_full="block", block_timeout=600) as rec:
        rec.oversized_alone = True
        rec.log("logits", big, token_ids=np.arange(600))
        rec.log("small", np.zeros((1, 4), np.float32), token_ids=[1])
    with td.open_trace(path) as trace:
        assert sorted(trace.names()) == ["logits", "small"]
        assert not trace.finals[0]["dropped_reasons"]


def test_the_request_in_use_is_kept_and_the_idlest_forgotten() -> None:
    """A long chat request that keeps decoding is not forgotten behind newer idle ones: a
    conflict with its early tokens is still seen."""
    book = TokenBook(limit=64 << 10)
    book.learn(*_rows("chat", 0, token=5))
    for i in range(2_000):
        book.learn(*_rows(f"idle-{i}", 0))
        book.learn(*_rows("chat", i + 1))
        book.take_new()
        assert book.nbytes <= book.limit
    assert book.forgotten > 1_000 and "chat" in book._sequences
    book.learn(*_rows("chat", 0, token=6))
    assert book.conflicts == 1


def test_a_long_decoding_request_grows_within_the_bound() -> None:
    book = TokenBook(limit=32 << 10)
    for i in range(4_000):
        book.learn(*_rows("long", i, token=i))
        assert book.nbytes <= book.limit
    request, position, token = book.take_new()
    assert list(position) == list(token) == list(range(len(position)))
    assert book.dropped == 4_000 - len(position) > 0


def test_show_says_when_the_token_table_hit_its_bound(tmp_path) -> None:
    """The final stats counted 249,957 token calls and 134,600 rows not learned; show said nothing."""
    from dataclasses import replace

    from tracediff.report.show import _token_line
    from tracediff.trace.summary import summarize

    path = tmp_path / "t.h5"
    with td.record(path) as rec:
        rec.log("h", np.zeros((2, 4), np.float32), token_ids=[1, 2])
    with td.open_trace(path) as trace:
        summary = summarize(trace)
    assert "incomplete" not in _token_line(summary).plain
    stats = {**summary.finals[0], "token_calls_dropped": 3, "token_rows_dropped": 40}
    bounded = replace(summary, finals=[stats])
    assert "incomplete: 3 calls, 40 rows not learned" in _token_line(bounded).plain
