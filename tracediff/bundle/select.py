"""What a bundle slices out of each trace, decided from the compare ``Report`` (plus the traces'
names and token tables, and for an ``incomplete`` verdict where its rows fall short): the rows
around the first divergence, the tensor that diverged, what it is computed from (the canonical
EAGLE-3 dataflow, docs/FORMAT.md) and what the diagnoses read as evidence; for ``incomplete``, the
whole request pair holding most rows of the short tensors that the other side lacks. ``ladder``
lists the windows to try, widest first, shrinking to fit a budget."""

from __future__ import annotations

import dataclasses
import glob
import re
from dataclasses import dataclass

from tracediff.diff.results import Report, Shortfall
from tracediff.eagle3 import names as tn
from tracediff.trace.reader import Trace
from tracediff.trace.slice import Selection, Span

RADII = (16, 8, 4, 2, 1, 0)  # positions kept each side of the focus, widest first
LAYER = re.compile(r"target\.layer\.(\d+)")
NORMED = re.compile(r"norm\((.+)\)")
SHOWN = 8  # names a terminal line lists
ALIGNMENT = tn.DRAFT_INPUT_IDS  # depth > 0 draft rows pair by what it says they were fed
# Tensors a diagnosis kind reads besides the ones its evidence names.
KIND_READS = {"vocab_map": (tn.DRAFT_D2T, tn.DRAFT_T2D, tn.DRAFT_TOKEN, tn.DRAFT_TOKEN_TARGET)}


@dataclass
class Focus:
    """Where a bundle's slices centre. ``tensor`` is the first diverging tensor (a's name; None when
    the report has none). Centred on its row; a static tensor's, or none, the slices show the start
    of a request pair; for an incomplete verdict (``short``: the tensors compared too little) whole
    requests first (``whole``), then rows around ``spots`` (per side, a row the other side lacks and
    the nearest row both hold: a slice must hold both kinds, on both sides, to fall short the same
    way). ``deps`` are nearest first (by row size when not centred), the order the budget drops them
    in reverse."""

    requests_a: tuple[str, ...] | None
    requests_b: tuple[str, ...] | None
    position: int
    depth: int
    tensor: str | None
    evidence: list[str]
    deps: list[str]
    present: list[str]  # every tensor name of either side (a's names)
    statics: set[str]  # the static ones among them
    anchor: str | None = None  # the smallest row tensor on both sides: kept when all else kept is static
    centred: bool = False  # on the first divergence's (or shortfall's) row; else the start of a request pair
    whole: bool = False  # the widest window keeps whole requests (an incomplete verdict's shortfall)
    short: list[str] = dataclasses.field(default_factory=list)  # tensors compared too little (incomplete)
    spots: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (first, last) positions kept


@dataclass(frozen=True)
class Window:
    """One size of the slices: ``radius`` positions each side of the focus (None: whole requests).
    ``wide``: '' (the focus's tensors), 'names' (every tensor, same rows), 'requests' (every tensor,
    whole requests), 'all' (the whole traces): tried when a slice does not reproduce the compare."""

    radius: int | None
    extra_depths: int
    deps: int
    evidence: bool = True
    stats: bool = True
    wide: str = ""


@dataclass
class LeftOut:
    """One thing a window leaves out to fit the budget: prose, and the tensor names it concerns
    (trace text: shown as code, never as prose)."""

    what: str
    names: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        """One line for a terminal: at most ``SHOWN`` names, then how many more."""
        more = f" and {len(self.names) - SHOWN} more" if len(self.names) > SHOWN else ""
        return self.what + ", ".join(self.names[:SHOWN]) + more


def left_out(focus: Focus, window: Window) -> list[LeftOut]:
    """What a window leaves out that the default one keeps, one entry each."""
    if window.wide:
        return []
    out = []
    if window.radius is not None and focus.whole:
        spots = " and ".join(f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi in focus.spots) \
            or str(focus.position)
        out.append(LeftOut(f"positions more than {window.radius} from {spots} (rows one side lacks, next to "
                           f"rows both hold; the default keeps the whole requests)"))
    elif window.radius is not None and window.radius < RADII[0] and not focus.centred:
        out.append(LeftOut(f"positions from {2 * window.radius + 1} on (the default keeps "
                           f"{2 * RADII[0] + 1})"))
    elif window.radius is not None and window.radius < RADII[0]:
        out.append(LeftOut(f"positions more than {window.radius} from the first divergence's "
                           f"({focus.position}; the default keeps {RADII[0]} each side)"))
    if window.radius is not None and (focus.whole or window.extra_depths < 1):
        out.append(LeftOut(f"draft depths past {focus.depth + window.extra_depths}"))
    if window.deps < len(focus.deps):
        out.append(LeftOut("tensors the first divergence depends on: " if focus.centred and focus.tensor
                           else "other tensors: ", focus.deps[window.deps:]))
    if not window.evidence and focus.evidence:
        out.append(LeftOut("tensors the diagnoses read: ", focus.evidence))
    if not window.stats:
        out.append(LeftOut("stats.json (summary statistics of the tensors not sliced)"))
    return out


def ladder(focus: Focus) -> list[Window]:
    """Windows from the default (widest) down to the least a bundle can hold, each keeping a subset
    of the one before (so their sizes only shrink: a binary search finds the widest that fits). What
    reproduces the compare goes last: first stats.json (a summary), then the dependency tensors
    (farthest first: context), then positions and depths around the focus, then (the diagnoses need
    them to say the same) the evidence tensors."""
    n = len(focus.deps)
    top = None if focus.whole else RADII[0]
    windows = [Window(top, 1, n), *(Window(top, 1, k, stats=False) for k in range(n, -1, -1))]
    windows += [Window(r, 1 if r >= 4 else 0, 0, stats=False) for r in RADII[0 if focus.whole else 1:]]
    if focus.evidence:
        windows.append(Window(0, 0, 0, evidence=False, stats=False))
    return windows


def widened(focus: Focus) -> list[Window]:
    """Wider windows than the default, for a slice that did not reproduce the compare."""
    default = Window(None if focus.whole else RADII[0], 1, len(focus.deps))
    return [dataclasses.replace(default, wide=w) for w in ("names", "requests", "all")]


def names_of(focus: Focus, window: Window) -> list[str]:
    """The tensors (a's names) a window keeps; the alignment tensor comes with any draft tensor."""
    chosen = [*([focus.tensor] if focus.tensor else []), *focus.short,
              *(focus.evidence if window.evidence else []), *focus.deps[: window.deps]]
    if ALIGNMENT in focus.present and any(n.startswith("draft.") for n in chosen):
        chosen.append(ALIGNMENT)
    if focus.anchor is not None and all(n in focus.statics for n in chosen):
        chosen.append(focus.anchor)  # compare aligns rows: a slice of static tensors alone has none
    return list(dict.fromkeys(chosen))


def selections(focus: Focus, window: Window,
               rename: dict[str, str] | None = None) -> tuple[Selection, Selection]:
    """(a's selection, b's selection) for one window."""
    if window.wide == "all":
        return Selection(), Selection()
    whole = window.wide == "requests" or window.radius is None
    positions = None
    if window.radius is not None and not whole:
        r = window.radius
        around = focus.spots or ([(focus.position, focus.position)] if focus.centred else [])
        positions = tuple(Span(max(0, lo - r), hi + r + 1) for lo, hi in around) or (Span(0, 2 * r + 1),)
    depths = None if whole else (Span(0, focus.depth + 1 + window.extra_depths),)
    names: list[str] | None = None
    in_b: list[str] = []
    if not window.wide:
        names = names_of(focus, window)
        in_b = [b for b, a in (rename or {}).items() if a in names]
    return (Selection(None if names is None else _globs(names), focus.requests_a, positions, None, depths),
            Selection(None if names is None else _globs([*names, *in_b]), focus.requests_b, positions, None,
                      depths))


def _globs(names: list[str]) -> tuple[str, ...]:
    """Exact names as globs (a name may hold ``*``, ``?`` or ``[``)."""
    return tuple(glob.escape(n) for n in names)


def focus_of(report: Report, a: Trace, b: Trace, rename: dict[str, str] | None = None,
             short: Shortfall | None = None) -> Focus:
    """Where to slice, from the report: the first divergence's row and tensor; else (``short``, an
    incomplete verdict's) the tensors compared too little, in the request pair where the other side
    lacks most of their rows; else the request pair the token view or token mismatch names, else the
    start of the best-matching request pair."""
    present = list(dict.fromkeys([*a.names(), *((rename or {}).get(n, n) for n in b.names())]))
    statics = {n for t in (a, b) for n in set(t.index.name[t.index.static].tolist())}
    both = set(a.names()) & {(rename or {}).get(n, n) for n in b.names()}
    rowed = sorted((n for n in present if n not in statics and n in both), key=lambda n: _row_bytes(a, b, n))
    anchor = rowed[0] if rowed else None
    first = report.first_divergence
    evidence = [n for n in _evidence(report) if n in present and (first is None or n != first.name)]
    mismatch = report.token_mismatch
    if first is not None and first.row.position >= 0:
        requests = ([first.row.request_a], [first.row.request_b])
        if mismatch is not None:  # the token check must see the same differing request
            requests[0].append(mismatch.request_a)
            requests[1].append(mismatch.request_b)
        aux = _aux_sources(a, b, evidence, present)
        deps = [n for n in dependencies(first.name, present, aux) if n not in evidence]
        position = max(first.row.position, 0)
        return Focus(tuple(dict.fromkeys(requests[0])), tuple(dict.fromkeys(requests[1])), position,
                     max(first.row.depth, 0), first.name, evidence, deps, present, statics, anchor,
                     centred=True)
    if short is not None and short.tensors:
        pair = short.requests or _request_pair(report, a, b)
        names = [n for n in short.tensors if n in present]
        return Focus(None if pair is None else _with_mismatch(pair[0], report, "a"),
                     None if pair is None else _with_mismatch(pair[1], report, "b"), short.position, 0, None,
                     [n for n in evidence if n not in names], [], present, statics, anchor,
                     centred=short.requests is not None, whole=True, short=names, spots=short.spots)
    # no divergence, or a static tensor's (no row): the start of a request pair, every tensor optional
    pair = _request_pair(report, a, b)
    name = None if first is None else first.name
    by_size = sorted((n for n in present if n != name), key=lambda n: _row_bytes(a, b, n))
    return Focus(None if pair is None else (pair[0],), None if pair is None else (pair[1],), 0, 0, name,
                 evidence, [n for n in by_size if n not in evidence], present, statics, anchor)


def _with_mismatch(request: str, report: Report, side: str) -> tuple[str, ...]:
    """``request``, and the side's requests of the text edit and the token mismatch (their checks must
    see them again)."""
    named = [m for m in (report.text_edit, report.token_mismatch) if m is not None]
    return tuple(dict.fromkeys([request, *(m.request_a if side == "a" else m.request_b for m in named)]))


def inputs(name: str, present: list[str], aux: list[str]) -> list[str]:
    """The tensors ``name`` is computed from in the canonical EAGLE-3 dataflow (docs/FORMAT.md)."""
    layers = sorted((int(m.group(1)), n) for n in present if (m := LAYER.fullmatch(n)))
    last = [layers[-1][1]] if layers else []
    if m := LAYER.fullmatch(name):
        i = int(m.group(1))
        return [tn.TARGET_EMBED] if i == 0 else [f"target.layer.{i - 1}"]
    graph = {
        tn.TARGET_FINAL_HIDDEN: last,
        tn.TARGET_LOGITS: [tn.TARGET_FINAL_HIDDEN, *last],
        tn.TARGET_TOKEN: [tn.TARGET_LOGITS],
        tn.TARGET_AUX: aux,
        tn.DRAFT_FC_IN: [tn.TARGET_AUX, *aux],
        tn.DRAFT_FC_OUT: [tn.DRAFT_FC_IN],
        tn.DRAFT_EMBED: [tn.DRAFT_INPUT_IDS],
        tn.DRAFT_HIDDEN: [tn.DRAFT_FC_OUT, tn.DRAFT_EMBED, tn.DRAFT_POSITIONS, tn.DRAFT_INPUT_IDS],
        tn.DRAFT_LOGITS: [tn.DRAFT_HIDDEN],
        tn.DRAFT_TOKEN: [tn.DRAFT_LOGITS],
        tn.DRAFT_TOKEN_TARGET: [tn.DRAFT_TOKEN, tn.DRAFT_D2T],
        tn.VERIFY_ACCEPT_LEN: [tn.DRAFT_TOKEN_TARGET, tn.TARGET_TOKEN],
    }
    return graph.get(name, [])


def dependencies(name: str, present: list[str], aux: list[str]) -> list[str]:
    """Every tensor upstream of ``name`` that a trace holds, nearest first (breadth-first)."""
    seen, frontier, out = {name}, [name], []
    while frontier:
        following = []
        for node in frontier:
            for parent in inputs(node, present, aux):
                if parent not in seen:
                    seen.add(parent)
                    following.append(parent)
                    if parent in present:
                        out.append(parent)
        frontier = following
    return out


def _aux_sources(a: Trace, b: Trace, evidence: list[str], present: list[str]) -> list[str]:
    """The target states that fill the aux slots on either side: as the contracts state them, else
    as the diagnoses found them, else every target state."""
    stated = [s for t in (a, b) for s in (t.contract.get("aux_sources") or []) if isinstance(s, str)]
    found = [n for n in evidence if n == tn.TARGET_EMBED or LAYER.fullmatch(n)]
    every = [n for n in present if n == tn.TARGET_EMBED or LAYER.fullmatch(n)]
    return list(dict.fromkeys(stated or found or every))


def _evidence(report: Report) -> list[str]:
    """The tensors the diagnoses name or read, in the order they name them."""
    names: list[str] = []
    for d in report.diagnoses:
        fields = vars(d.evidence) if dataclasses.is_dataclass(d.evidence) else {}
        for key in ("tensor", "weight_name"):
            if isinstance(fields.get(key), str):
                names.append(fields[key])
        for key in ("slots_a", "slots_b"):
            for slot in fields.get(key) or []:
                if isinstance(slot, str):
                    names.append(m.group(1) if (m := NORMED.fullmatch(slot)) else slot)
        names += KIND_READS.get(d.kind, ())
    return list(dict.fromkeys(names))


def _request_pair(report: Report, a: Trace, b: Trace) -> tuple[str, str] | None:
    """The requests to show when no row diverged: the report's text edit, token view or token
    mismatch, else b's first request and the request of a sharing the longest token prefix with it;
    None when a side knows no tokens."""
    tables = a.request_tokens(), b.request_tokens()
    if not tables[0].requests() or not tables[1].requests():
        return None
    for named in (report.text_edit, report.tokens, report.token_mismatch):
        if named is not None and named.request_a in tables[0].requests() \
                and named.request_b in tables[1].requests():
            return named.request_a, named.request_b
    target = tables[1].sequence(tables[1].requests()[0])[1]

    def shared(request: str) -> int:
        tokens = tables[0].sequence(request)[1]
        n = min(len(tokens), len(target))
        differ = (tokens[:n] != target[:n]).nonzero()[0]
        return int(differ[0]) if len(differ) else n

    return max(tables[0].requests(), key=shared), tables[1].requests()[0]


def _row_bytes(a: Trace, b: Trace, name: str) -> int:
    """Bytes of one row (a static tensor: the whole record) of ``name``, the larger side's."""
    sizes = [0]
    for trace in (a, b):
        hits = trace.select(name=name)
        if len(hits):
            i = hits[0]
            rows = 1 if trace.index.static[i] else max(1, int(trace.index.n_rows[i]))
            sizes.append(int(trace.index.nbytes[i]) // rows)
    return max(sizes)
