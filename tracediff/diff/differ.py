"""Execute a comparison plan: read corresponding rows chunk by chunk (the next chunk is read while
this one is measured), check tolerances and keep per-tensor tallies. The first failing chunk in
the plan's order holds the first divergence; tensors failing later are downstream of it. A tensor
stored as integers on one side and floats on the other is measured by value too, but is a
``dtype_mismatch`` whatever its values: it never holds the first divergence, and never matches.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tracediff.diff.align import first_token_difference
from tracediff.diff.contract_diff import contract_diff
from tracediff.diff.edits import text_edit
from tracediff.diff.findings import Side
from tracediff.diff.finite import measure_finite_parts
from tracediff.diff.metrics import MAPPED_DTYPES, Engine, engine_for
from tracediff.diff.pair import Pair
from tracediff.diff.plan import CHUNK_BYTES, Chunk, Plan, TensorPlan
from tracediff.diff.profile import ProfileTally
from tracediff.diff.results import ContractDiff, Coverage, RowRef, TensorResult, TextEdit, TokenMismatch
from tracediff.diff.shapes import agreement, kinds_differ
from tracediff.diff.statics import compare_static
from tracediff.diff.tolerance import Tolerances, failing_rows
from tracediff.trace.dtypes import FLOAT_TAGS, decode
from tracediff.trace.reader import InPlaceRows, Trace

SAMPLE = 64  # failing rows kept per tensor for the diagnoses
WINDOWS_AHEAD = 2  # windows read ahead of the one being measured
LARGER_IS_WORSE = ("max_abs", "mean_abs", "rel_l2", "max_rel", "kl")
Progress = Callable[[int, int], None]  # (bytes compared so far, bytes to compare)


@dataclass
class NonFinite:
    rows: int = 0
    first_row: int = -1  # row number into the plan's keys


@dataclass
class Tally:
    """What one tensor's report line does not hold: row numbers (into the plan's keys) of the first
    failing rows and per side the first row holding NaN/Inf (for the diagnoses), and the error per
    (depth, position cell) (for the report's profile)."""

    profile: ProfileTally
    bad_rows: Pair[list[int]] = field(default_factory=lambda: Pair([], []))
    non_finite: Pair[NonFinite] = field(default_factory=lambda: Pair(NonFinite(), NonFinite()))

    @classmethod
    def of(cls, tensor: TensorPlan) -> Tally:
        keys = tensor.keys.a
        return cls(ProfileTally(int(keys.position.max(initial=0)), int(keys.depth.max(initial=0))))


@dataclass
class Comparison:
    """Everything compare found, as plain data for the diagnoses and the report."""

    paths: Pair[list[str]]
    plan: Plan = field(repr=False)
    tensors: list[TensorResult]
    contract: ContractDiff
    token_mismatch: TokenMismatch | None
    text_edit: TextEdit | None  # both sides recorded a request's text and it differs (diff/edits.py)
    tallies: dict[str, Tally] = field(default_factory=dict, repr=False)
    first_non_finite: dict[Side, str] = field(default_factory=dict)  # side -> tensor met first with NaN/Inf
    tolerances: Tolerances = field(default_factory=Tolerances, repr=False)

    @property
    def first_divergence(self) -> TensorResult | None:
        return next((t for t in self.tensors if t.status == "diverged"), None)


def compare_traces(traces: Pair[Trace], plan: Plan, tolerances: Tolerances | None = None,
                   stop_at_first: bool = False, progress: Progress | None = None) -> Comparison:
    """Execute ``plan`` (``plan.make_plan``'s, from key columns): measure every chunk (or only up to
    the first failing one when ``stop_at_first``: tensors not fully read are then reported as
    ``unchecked``). ``progress`` hears of every chunk measured."""
    tolerances = tolerances or Tolerances()
    results = {t.name: _initial(t) for t in plan.tensors}
    comparison = Comparison(paths=traces.map(lambda t: [str(p) for p in t.paths]), plan=plan, tensors=[],
                            contract=contract_diff(traces),
                            token_mismatch=first_token_difference(plan.prefixes),
                            text_edit=text_edit(plan.prefixes, plan.departed),
                            tallies={t.name: Tally.of(t) for t in plan.tensors}, tolerances=tolerances)
    first_failure: dict[str, tuple[int, int]] = {}  # name -> (baseline step of its first failing row, order)
    across_kinds = {t.name for t in plan.tensors if kinds_differ((t.keys.a.dtype, t.keys.b.dtype))}
    done, total, read = 0, plan.nbytes, 0
    engine = engine_for(total)  # small compares never wait for the compiled kernels to build
    for chunk, values in read_ahead(traces, plan.chunks):
        if stop_at_first and first_failure and chunk.window > plan.chunks[done - 1].window:
            break  # every chunk of the window with the first failure is measured: it is settled
        done += 1
        name = chunk.tensor.name
        bad = _measure(traces, chunk, values, results[name], comparison, tolerances, engine)
        if bad is not None and name not in first_failure and name not in across_kinds:
            first_failure[name] = (int(chunk.tensor.keys.a.step[chunk.rows.a[bad]]), chunk.order)
        if progress is not None:
            read += chunk.nbytes.a + chunk.nbytes.b
            progress(read, total)
    failing = sorted(first_failure, key=lambda n: first_failure[n])
    unread = {c.tensor.name for c in plan.chunks[done:]}
    for name, result in results.items():
        result.profile = comparison.tallies[name].profile.profile()
        if result.status != "not_comparable":
            continue  # a problem found while planning
        if name in across_kinds:
            result.status = "dtype_mismatch"
            result.add_note(agreement(result.rows, result.failed))
        elif name in failing:
            result.status = "diverged" if name == failing[0] else "downstream"
        elif name in unread:
            result.status = "unchecked"
        elif result.rows:
            result.status = "match"
    statics = [compare_static(traces, pair, tolerances) for pair in plan.statics]
    for result in statics:  # statics have no step: after every row tensor in the first-divergence order
        if result.status == "diverged" and failing:
            result.status = "downstream"
        elif result.status == "diverged":
            failing.append(result.name)
    comparison.tensors = ([results[t.name] for t in plan.tensors] + statics
                          + [TensorResult(m.name, "mixed_records", note=m.note, coverage=m.coverage)
                             for m in plan.mixed]
                          + [TensorResult(n, "missing_in_b") for n in plan.missing_in_b]
                          + [TensorResult(n, "missing_in_a") for n in plan.missing_in_a])
    return comparison


def _initial(tensor: TensorPlan) -> TensorResult:
    """A tensor's result before any row is read: what the plan knows (coverage, problems)."""
    keys, matched = tensor.keys, tensor.matched
    skipped = matched.skipped
    compared = (len(np.unique(matched.rows.a)), len(np.unique(matched.rows.b)))
    coverage = Coverage.of((len(keys.a), len(keys.b)), len(matched.rows.a), compared, skipped.a, skipped.b,
                           depths=matched.by_depth)
    return TensorResult(tensor.name, tensor.problem or "not_comparable", dtypes=(keys.a.dtype, keys.b.dtype),
                        shapes=(list(keys.a.row_shape), list(keys.b.row_shape)), coverage=coverage,
                        note=tensor.note)


@dataclass
class ChunkRows:
    """One chunk's rows as read: raw data, or (one dtype of ``MAPPED_DTYPES`` both sides,
    single-file uncompressed traces) the file offset of each row, for the kernel to read them in
    place from the page cache."""

    raw: Pair[np.ndarray] | None = None
    at: Pair[np.ndarray] | None = None


def read_ahead(traces: Pair[Trace], chunks: list[Chunk],
               window_bytes: int = CHUNK_BYTES) -> Iterator[tuple[Chunk, ChunkRows]]:
    """Each chunk with its rows. A second thread prepares whole windows, up to ``WINDOWS_AHEAD``
    ahead of the one being measured, so that the disk always has work (preads, madvise and the
    kernels let go of the GIL): rows read in place are mapped, a few sequential spans a window, and
    unmapped when their window is done; other rows are copied into a ring of reused buffers (fresh
    arrays would cost a page fault per 4 KiB). A chunk's rows are valid until its window is done:
    memory stays at ``WINDOWS_AHEAD + 1`` windows, whatever the trace size.

    Windows here are read windows (``read_windows``): a plan window larger than ``window_bytes`` a
    side (one step holding a huge record: 600 x 128,256 fp32 logits are 307 MB) is read in pieces
    of about ``window_bytes``, so that memory stays bounded by bytes, not by the layout."""
    windows = read_windows(chunks, window_bytes)
    order = list(windows)  # chunks come in window order
    ring = [Pair(np.empty(0, np.uint8), np.empty(0, np.uint8)) for _ in range(WINDOWS_AHEAD + 1)]

    def prepare(slot: int, window: int) -> tuple[dict[int, ChunkRows], Pair[list]]:
        """Rows of every chunk of a window, and the spans mapped for them (to release)."""
        offsets = {i: _row_offsets(traces, chunks[i]) for i in windows[window]}
        in_place = {i: at for i, at in offsets.items() if at is not None}
        rows = {i: ChunkRows(at=at) for i, at in in_place.items()}
        mapped = Pair.collect([chunks[i].tensor.keys.zip(chunks[i].rows, at).starmap(InPlaceRows)
                               for i, at in in_place.items()])
        spans = traces.zip(mapped).starmap(Trace.hold)
        copied = [i for i in windows[window] if i not in rows]
        need = Pair.collect([chunks[i].nbytes for i in copied]).map(sum)
        ring[slot] = ring[slot].zip(need).starmap(_at_least)
        used = Pair(0, 0)
        for i in copied:
            chunk = chunks[i]
            into = ring[slot].zip(used, chunk.nbytes).starmap(lambda buf, at, n: buf[at : at + n])
            rows[i] = ChunkRows(raw=traces.zip(chunk.tensor.keys, chunk.rows, into).starmap(Trace.gather))
            used = used.zip(chunk.nbytes).starmap(operator.add)
        return rows, spans

    with ThreadPoolExecutor(max_workers=1) as pool:
        ahead = {w: pool.submit(prepare, k, w) for k, w in enumerate(order[: len(ring)])}
        try:
            for k, window in enumerate(order):
                rows, spans = ahead.pop(window).result()
                for i in windows[window]:
                    yield chunks[i], rows[i]
                traces.zip(spans).starmap(Trace.release)
                if k + len(ring) < len(order):
                    ahead[order[k + len(ring)]] = pool.submit(prepare, k % len(ring), order[k + len(ring)])
        finally:  # stopped early: windows not yet started are not read
            for future in ahead.values():
                future.cancel()


def read_windows(chunks: list[Chunk], window_bytes: int = CHUNK_BYTES) -> dict[int, list[int]]:
    """Chunk numbers (into ``chunks``, in order) grouped into the windows ``read_ahead`` reads at
    once. A plan window is read whole where it holds at most ``window_bytes`` and a quarter on each
    side (a window of whole steps ends past its ``chunk_bytes`` by part of a step); a larger one
    (one step holding a huge record) is cut between chunks into pieces of at most ``window_bytes``
    (a piece holds one chunk at least: a chunk holds ``chunk_bytes``, or a single larger row).
    Grouping reads only: the chunks that settle the first divergence are still the plan window's."""
    by_plan: dict[int, list[int]] = {}
    for i, chunk in enumerate(chunks):
        by_plan.setdefault(chunk.window, []).append(i)
    windows: dict[int, list[int]] = {}
    limit = max(window_bytes, 1)
    for members in by_plan.values():
        sizes = [max(chunks[i].nbytes.a, chunks[i].nbytes.b) for i in members]
        if sum(sizes) <= limit + limit // 4:
            windows[len(windows)] = members
            continue
        piece: list[int] = []
        held = 0
        for i, size in zip(members, sizes):
            if piece and held + size > limit:
                windows[len(windows)] = piece
                piece, held = [], 0
            piece.append(i)
            held += size
        windows[len(windows)] = piece
    return windows


def _at_least(buffer: np.ndarray, nbytes: int) -> np.ndarray:
    return buffer if buffer.size >= nbytes else np.empty(nbytes, dtype=np.uint8)


def _row_offsets(traces: Pair[Trace], chunk: Chunk) -> Pair[np.ndarray] | None:
    """File offsets of a chunk's rows where both sides can be read in place: one dtype the kernels
    read from a mapped file (``MAPPED_DTYPES``), single-file traces whose records lie uncompressed."""
    keys = chunk.tensor.keys
    if not keys.a.dtype == keys.b.dtype or keys.a.dtype not in MAPPED_DTYPES:
        return None
    at = traces.zip(keys, chunk.rows).starmap(Trace.row_offsets)
    return None if at.a is None or at.b is None else Pair(at.a, at.b)


def _measure(traces: Pair[Trace], chunk: Chunk, rows: ChunkRows, result: TensorResult, comparison: Comparison,
             tolerances: Tolerances, engine: Engine) -> int | None:
    """Fold one chunk into the tensor's result; the index in the chunk of its first failing row."""
    result.rows += len(chunk.rows.a)
    tally = comparison.tallies[result.name]
    dtypes = (chunk.tensor.keys.a.dtype, chunk.tensor.keys.b.dtype)
    if rows.at is not None:
        width = int(np.prod(chunk.tensor.keys.a.row_shape, dtype=np.int64))
        files = traces.map(lambda t: t.mapped())
        metrics = engine.measure_mapped(result.name, files, rows.at, width, dtypes[0])
    else:
        assert rows.raw is not None  # rows not mapped were read
        metrics = engine.measure_rows(result.name, dtypes, rows.raw.a, rows.raw.b)
    if dtypes[0] in FLOAT_TAGS or dtypes[1] in FLOAT_TAGS:
        same = _note_non_finite(traces, metrics, chunk, tally, comparison, engine)
        if same:
            result.add_note("rows holding NaN/Inf at the same elements on both sides are compared on their "
                            "finite elements")
    for k, v in metrics.items():
        # a NaN row (NaN/Inf on a side) is the worst there is: it stays the worst value once seen
        if not len(v):
            continue
        worst = np.nan if np.isnan(v).any() else (v.max() if k in LARGER_IS_WORSE else v.min())
        old = result.worst.get(k)
        if old is None or np.isnan(worst) or (worst > old if k in LARGER_IS_WORSE else worst < old):
            result.worst[k] = float(worst)
    bad = failing_rows(metrics, tolerances.bounds(result.name, dtypes, metrics))
    result.add_note(tolerances.unused_rule(result.name, metrics))
    keys = chunk.tensor.keys.a
    tally.profile.add(keys.position[chunk.rows.a], keys.depth[chunk.rows.a], bad, metrics)
    if not bad.any():
        return None
    result.failed += int(bad.sum())
    _note_failures(result, tally, chunk, bad, metrics)
    return int(np.argmax(bad))


def _note_failures(result: TensorResult, tally: Tally, chunk: Chunk, bad: np.ndarray,
                   metrics: dict[str, np.ndarray]) -> None:
    where = np.flatnonzero(bad)
    room = SAMPLE - len(tally.bad_rows.a)
    tally.bad_rows.a.extend(chunk.rows.a[where[:room]].tolist())
    tally.bad_rows.b.extend(chunk.rows.b[where[:room]].tolist())
    if result.first_bad is not None:
        return
    i = int(where[0])
    keys, ra, rb = chunk.tensor.keys, int(chunk.rows.a[i]), int(chunk.rows.b[i])
    result.first_bad = RowRef(
        request_a=str(keys.a.request[ra]), request_b=str(keys.b.request[rb]),
        position=int(keys.a.position[ra]), depth=int(keys.a.depth[ra]),
        step_a=int(keys.a.step[ra]), step_b=int(keys.b.step[rb]),
        metrics={k: float(v[i]) for k, v in metrics.items()},
    )


def _note_non_finite(traces: Pair[Trace], metrics: dict[str, np.ndarray], chunk: Chunk, tally: Tally,
                     comparison: Comparison, engine: Engine) -> int:
    """A row holding NaN/Inf on either side makes its max_abs non-finite: only those rows are
    read again and scanned, so the common all-finite chunk costs one check of a per-row array.
    Rows whose NaN/Inf sit at the same elements with the same values on both sides hold the same
    data: their metrics are measured again over the finite elements, and they are not where a NaN
    was produced on one side, so the diagnoses never see them. Of the other rows, the first in the
    chunk (the baseline's order) names the side met first. Returns how many rows were the same."""
    suspects = np.flatnonzero(~np.isfinite(metrics["max_abs"]))
    if not len(suspects):
        return 0
    keys = chunk.tensor.keys
    decoded = traces.zip(keys, chunk.rows).starmap(
        lambda trace, k, rows: decode(trace.gather(k, rows[suspects]), k.dtype).reshape(len(suspects), -1))
    same = measure_finite_parts(decoded, suspects, metrics, chunk.tensor.name, engine)
    hits = decoded.map(lambda values: suspects[~np.isfinite(values).all(axis=1) & ~same])
    first = hits.map(lambda hit: hit[0] if len(hit) else len(metrics["max_abs"]))
    sides: tuple[Side, ...] = ("b", "a") if first.b < first.a else ("a", "b")
    for side in sides:
        hit = getattr(hits, side)
        if not len(hit):
            continue
        seen = getattr(tally.non_finite, side)
        if not seen.rows:
            seen.first_row = int(getattr(chunk.rows, side)[hit[0]])
        seen.rows += len(hit)
        comparison.first_non_finite.setdefault(side, chunk.tensor.name)
    return int(same.sum())
