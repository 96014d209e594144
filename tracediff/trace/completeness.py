"""How complete a trace is: what its recorder dropped (per tensor and reason), who stopped
recording (the recorder or a producer: why, after which step), what each producer attached meant to
record, what the user filtered out, and whether every writer closed.

Read from the end-of-run metadata each writer writes at close (docs/FORMAT.md: ``dropped_by``,
``producers``, ``queue``) and, for traces written before those keys, from what they already held
(``dropped``, ``dropped_reasons``, ``stopped``, the contract's ``*_recording_stopped``), so that a
trace that was whole then still reads as whole. ``Trace.completeness`` is the one place this is
computed; compare turns the gaps into its verdict (diff/verdict.py), show and the reports print them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

GapKind = Literal["dropped", "stopped", "unrecorded", "not_closed", "ranks_missing"]

RECORDER = "recorder"  # ``Gap.by`` for what the recorder itself did (drops, its own stop)


@dataclass(frozen=True)
class Gap:
    """One way a trace holds less than its run logged. ``tensor`` is "" for the whole trace (a stop,
    a writer that never closed, missing rank files)."""

    kind: GapKind
    tensor: str
    count: int  # records dropped ("dropped"); 0 otherwise
    logged: int  # records of ``tensor`` the host logged (written + dropped); 0 where not counted
    cause: str  # "queue full at 2 MiB"
    remedy: str  # 'raise queue_bytes or use on_full="block"'
    by: str = RECORDER  # who: the recorder, or the producer that stopped or attached the tensor
    step: int | None = None  # the last step recorded before a stop

    def line(self, side: str) -> str:
        """One sentence naming ``side`` (the trace's source, e.g. "serving"): count, cause, remedy."""
        why = f"{self.cause}; {self.remedy}" if self.remedy else self.cause
        if self.kind == "dropped":
            of = f" of {self.logged}" if self.logged else ""
            records = "record" if (self.logged or self.count) == 1 else "records"
            return f"{side} dropped {self.count}{of} {self.tensor} {records} ({why})"
        if self.kind == "unrecorded":
            return f"{side} recorded no {self.tensor} although {self.by} was attached to record it ({why})"
        if self.kind == "stopped":
            who = "its recorder" if self.by == RECORDER else self.by
            after = "" if self.step is None else f" after step {self.step}"
            return f"{side} stopped recording{after}: {who} stopped ({why})"
        return f"{side} {why}"  # not_closed, ranks_missing: the cause reads on from the side


@dataclass(frozen=True)
class Completeness:
    """A trace's gaps, and the name globs its user kept and excluded (what it never meant to hold)."""

    gaps: tuple[Gap, ...] = ()
    names: tuple[str, ...] = ("*",)  # the recorder's ``names`` filter
    exclude: tuple[str, ...] = ()  # the recorder's ``exclude`` filter
    attached: dict[str, tuple[str, ...]] = field(default_factory=dict)  # producer -> name globs
    selected: tuple[tuple[str, ...], ...] = ()  # each slice's (or bundle's) name selection, outermost first
    sampled: bool = False  # recorded every N-th step or some requests only: absence proves nothing

    @property
    def complete(self) -> bool:
        return not self.gaps

    def filtered_out(self, name: str) -> bool:
        """Whether the user's filters kept ``name`` out of this trace (never a gap): the recorder's, or
        a slice's selection."""
        kept = any(fnmatchcase(name, g) for g in self.names)
        if any(not any(fnmatchcase(name, g) for g in chosen) for chosen in self.selected):
            return True
        return not kept or any(fnmatchcase(name, g) for g in self.exclude)

    def whole_trace(self) -> list[Gap]:
        return [g for g in self.gaps if not g.tensor]

    def of(self, name: str) -> list[Gap]:
        return [g for g in self.gaps if g.tensor == name]


# The remedy for each reason a record is dropped (record/queue.py's reasons; "unrecordable" is a
# tensor no trace can hold, a bad log call the same).
def _remedy(reason: str, queue: dict) -> tuple[str, str]:
    """(cause, remedy) of records dropped for ``reason`` under the recorder's queue settings."""
    if reason == "queue full":
        size = queue.get("bytes")
        at = f" at {_mib(size)}" if isinstance(size, int) and not isinstance(size, bool) else ""
        if queue.get("on_full") == "block":  # it waited block_timeout for room, then dropped
            return f"queue full{at} past block_timeout", "raise queue_bytes or block_timeout"
        return f"queue full{at}", 'raise queue_bytes or use on_full="block"'
    if reason == "larger than queue_bytes":
        size = queue.get("bytes")
        at = f" (queue_bytes {_mib(size)})" if isinstance(size, int) and not isinstance(size, bool) else ""
        return f"a record larger than the whole queue{at}", "raise queue_bytes above the largest record"
    if reason == "closed":
        return "logged after the recorder closed", "log before close(); close after the last step"
    if reason == "abandoned":
        return "the writer was still busy when close() gave up", "give close() a longer close_timeout"
    if reason == "stopped":
        return "logged after recording stopped", "see why it stopped"
    return reason, "see the recorder's warning for the tensor it could not hold"


def _mib(n: int) -> str:
    """2 MiB, 97.7 KiB, 100 bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def _counts(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _globs(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return default


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def completeness(meta: dict, finals: list[dict | None], contract: dict, logged: dict[str, int] | None,
                 world_size: int = 1, files: int = 1, last_step: int | None = None) -> Completeness:
    """The gaps of a trace from its files' metadata: ``logged`` holds the records written per name
    (None: not known, as in the recorder itself), ``last_step`` the highest step recorded (where a
    stop names none), ``files`` the files opened of the run's ``world_size``."""
    said = meta.get("filters")
    filters: dict = said if isinstance(said, dict) else {}
    gaps: list[Gap] = []
    attached: dict[str, set[str]] = {}
    stops: dict[str, Gap] = {}  # who -> the first stop seen (rank files repeat a producer's stop)
    dropped: dict[tuple[str, str], int] = {}
    queue: dict = {}
    for final in finals:
        if not isinstance(final, dict):
            continue
        settings = final.get("queue")
        queue = settings if isinstance(settings, dict) else queue
        by = final.get("dropped_by")
        if isinstance(by, dict):
            for name, reasons in by.items():
                for reason, n in _counts(reasons).items():
                    dropped[(str(name), reason)] = dropped.get((str(name), reason), 0) + n
        else:  # written before dropped_by: one reason for all when the trace had one
            reasons = _counts(final.get("dropped_reasons"))
            reason = next(iter(reasons)) if len(reasons) == 1 else "; ".join(sorted(reasons)) or "dropped"
            for name, n in _counts(final.get("dropped")).items():
                dropped[(name, reason)] = dropped.get((name, reason), 0) + n
        stopped = final.get("stopped")
        if isinstance(stopped, str) and stopped and RECORDER not in stops:
            stops[RECORDER] = Gap("stopped", "", 0, 0, stopped, _stop_remedy(stopped), RECORDER, last_step)
        producers = final.get("producers")
        for producer, said in (producers.items() if isinstance(producers, dict) else ()):
            if not isinstance(said, dict):
                continue
            attached.setdefault(str(producer), set()).update(_globs(said.get("names"), ()))
            why = said.get("stopped")
            if isinstance(why, str) and why and producer not in stops:
                step = _step(said.get("step"))
                stops[str(producer)] = Gap("stopped", "", 0, 0, why, PRODUCER_REMEDY, str(producer),
                                           last_step if step is None else step)
    for key, why in contract.items():  # the stop flags integrations set before producers was written
        if key.endswith("_recording_stopped") and isinstance(why, str) and why:
            producer = key[: -len("_recording_stopped")]
            if producer not in stops:
                stops[producer] = Gap("stopped", "", 0, 0, why, PRODUCER_REMEDY, producer, last_step)
    gaps.extend(stops.values())
    # a copy (slice, convert) of a trace whose writer never closed is closed, and says it: closed false
    if any(final is None or final.get("closed") is False for final in finals):
        gaps.append(Gap("not_closed", "", 0, 0, "was never closed by its writer (killed, or still "
                        "recording): rows after its last flush are missing",
                        "let the recording process end normally, or close() the recorder"))
    if world_size > files and not isinstance(meta.get("sliced_from"), dict):  # a slice leaves out empty ranks
        gaps.append(Gap("ranks_missing", "", 0, 0, f"holds {files} of the run's {world_size} rank files: the "
                        "other ranks' rows are missing", "give compare every rank file"))
    for (name, reason), n in sorted(dropped.items()):
        cause, remedy = _remedy(reason, queue)
        earlier = next((i for i, g in enumerate(gaps) if g.kind == "dropped" and g.tensor == name), None)
        total = 0 if logged is None or isinstance(meta.get("sliced_from"), dict) else \
            logged.get(name, 0) + sum(m for (other, _), m in dropped.items() if other == name)
        gap = Gap("dropped", name, n, total, cause, remedy)
        if earlier is None:
            gaps.append(gap)
        else:  # several reasons for one tensor: one gap, the causes joined
            old = gaps[earlier]
            gaps[earlier] = Gap("dropped", name, old.count + n, total, f"{old.cause}, {cause}",
                                f"{old.remedy}; {remedy}")
    names = _globs(filters.get("names"), ("*",))
    exclude = _globs(filters.get("exclude"), ())
    every, requests = filters.get("every"), filters.get("requests")
    sampled = (isinstance(every, int) and every > 1) or requests is not None or bool(meta.get("request_gate"))
    return Completeness(tuple(gaps), names, exclude, {p: tuple(sorted(g)) for p, g in attached.items()},
                        _selections(meta), sampled)


def _selections(meta: dict) -> tuple[tuple[str, ...], ...]:
    """The name selections of a slice and of the slices it was cut from (``sliced_from`` and its
    ``previous``), those that chose names."""
    out, sliced, depth = [], meta.get("sliced_from"), 0
    while isinstance(sliced, dict) and depth < 64:
        selection = sliced.get("selection")
        chosen = selection.get("names") if isinstance(selection, dict) else None
        if chosen is not None:
            out.append(_globs(chosen, ()))
        sliced, depth = sliced.get("previous"), depth + 1
    return tuple(out)


PRODUCER_REMEDY = "see the producer's warning where it stopped; recording of the rest went on"


def _stop_remedy(stopped: str) -> str:
    """What lets the next recording go on where this one stopped (the recorder's own reasons)."""
    if "max_bytes" in stopped or "byte budget" in stopped:
        return "raise max_bytes"
    if "RLIMIT_FSIZE" in stopped:
        return "raise the file size limit (ulimit -f) or record less (names, exclude, every)"
    if "disk" in stopped or "No space" in stopped:
        return "free disk space or record less (names, exclude, every)"
    if "abandoned" in stopped:
        return "give close() a longer close_timeout"
    return "see the recorder's warning"


def summary(gaps: tuple[Gap, ...] | list[Gap], where: str) -> str:
    """One line for the recorder's close and ``tracediff record``: the first gap, and how many more
    ``tracediff show`` lists."""
    import shlex

    more = f" (and {len(gaps) - 1} more: tracediff show {shlex.quote(where)})" if len(gaps) > 1 else ""
    return f"incomplete: {gaps[0].line('the trace')}{more}"


def unrecorded(completeness: Completeness, name: str) -> Gap | None:
    """A gap when a producer this trace attached meant to record ``name`` (a glob of it matches) and
    the trace holds none of it, unless the user's filters kept it out (names, exclude, a slice's
    selection) or may have (every N-th step, some requests only), or its records were dropped (a
    gap of their own). Asked of names the trace holds none of."""
    if completeness.sampled or completeness.filtered_out(name) or completeness.of(name):
        return None  # (kept out, sampled out, or all its records dropped: a gap of their own)
    for producer, globs in completeness.attached.items():
        if any(fnmatchcase(name, g) for g in globs):
            return Gap("unrecorded", name, 0, 0, "attached but never recorded",
                       "its hooks never ran: see the producer's warnings", producer)
    return None


__all__ = ["RECORDER", "Completeness", "Gap", "GapKind", "completeness", "summary", "unrecorded"]
