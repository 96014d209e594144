"""What every copy of a trace's records shares (``convert``, ``slice``, and bundles built on slices):
the records read for copying, each carrying its source's stored checksums when the read did not
check them, and the refusal of outputs that would hide or join another trace's rank files."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import numpy as np

from tracediff.errors import InputError
from tracediff.trace.output import check_outputs
from tracediff.trace.reader import Trace, rank_files
from tracediff.trace.schema import Record, corrupt_record, record_checksums, rows_crc

RANKED = re.compile(r"(.+)\.rank\d+")  # the stem of a rank file's name: ``NAME.rankN`` (+ its suffix)


def read_copy(trace: Trace, i: int, rows: np.ndarray | None = None) -> Record:
    """The record at index position ``i`` to be written into a copy, ``rows`` of it (all: None). A
    copy's checksums must be the source's (docs/FORMAT.md "Checksums"): from a trace read unchecked
    (--no-verify) a whole record carries the checksums its file stores, so corrupt bytes still fail
    theirs in the copy; a subset of rows gets new ones, so its record is checked first."""
    record = trace.read(i)
    stored = None
    if not trace.verify:
        file, slot = trace.files[int(trace.index.part[i])], int(trace.index.slot[i])
        stored = file.stored_checksums(slot)
        if stored is not None and rows is not None and record_checksums(record) != stored:
            raise corrupt_record(file.path, slot, *file.describe_slot(slot))
    if rows is None:
        record.checksums = stored
        return record
    record.data = record.data[rows]
    record.request, record.position, record.token_id = (record.request[rows], record.position[rows],
                                                        record.token_id[rows])
    return record


def check_rewritten(trace: Trace, part: int) -> None:
    """Refuse a rank file's metadata and ``__tokens__`` records that fail their checksums before a
    copy writes them anew with new checksums (metadata as the copy's, the tokens merged into one
    record), so that --no-verify never turns corrupt bytes into sound ones; a trace read checked
    has checked them already."""
    file = trace.files[part]
    if trace.verify:
        return
    file.check_metadata()
    for slot in file.token_slots.tolist():
        stored = file.stored_checksums(slot)
        if stored is not None and rows_crc(*file.read_keys(slot)) != stored[2]:
            raise corrupt_record(file.path, slot, *file.describe_slot(slot))


def output_paths(trace: Trace, dst: Path) -> list[Path]:
    """One output per rank file of ``trace``: ``dst`` itself, or ``dst`` stem + ``.rankN``."""
    if len(trace.files) == 1:
        return [dst]
    return [dst.with_name(f"{dst.stem}.rank{part}{dst.suffix}") for part in range(len(trace.files))]


def check_copy_outputs(dst: Path, outputs: list[Path], sources: list[Path], force: bool,
                       what: str = "copy") -> None:
    """Refuse outputs that would overwrite a file unless forced (the input, a link or a non-regular
    file ever), or hide rank files, or join an existing trace's rank files (``what``: the copy's
    noun in the message)."""
    check_outputs(outputs, sources, force)
    siblings = [] if dst.exists() else [p for p in rank_files(dst) if p != dst]
    if len(outputs) == 1 and siblings:
        raise InputError(dst, f"is the stem of the rank files {', '.join(p.name for p in siblings)}: a "
                              "trace written there would hide them (choose another name)")
    if len(outputs) > 1 and dst.exists():
        raise InputError(dst, f"exists: it would hide the {what}'s rank files (choose another name)")
    extra = [p for p in siblings if p not in outputs]
    if len(outputs) > 1 and extra:  # more rank files than the copy writes: read with it as one trace
        raise InputError(extra[0], f"exists: it would be read as a rank of the {what} (choose another "
                                      "name)")
    for out in outputs:
        joined = [p for p in rank_set(out) if p not in outputs]
        if joined:
            raise InputError(out, f"would join the rank files {', '.join(p.name for p in joined)} (read with "
                                  "them as one trace): choose another name")


def rank_set(path: Path) -> list[Path]:
    """The existing files ``NAME.rankN.EXT`` of the trace a file named ``NAME.rankM.EXT`` would
    belong to (none for other names)."""
    m = RANKED.fullmatch(path.stem)
    if m is None:
        return []
    named = re.compile(re.escape(m.group(1)) + r"\.rank\d+" + re.escape(path.suffix))
    return sorted(p for p in path.parent.glob(f"{glob.escape(m.group(1))}.rank*{glob.escape(path.suffix)}")
                  if named.fullmatch(p.name) and p.is_file())
