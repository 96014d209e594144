"""What ``compare`` returns: the typed report every renderer (terminal, JSON, Markdown, bundles)
reads. Plain dataclasses and Literals, so that ``Report.to_json`` / ``Report.from_json``
round-trip exactly and docs/REPORT.md can be checked against the code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tracediff.diff.findings import Diagnosis
from tracediff.eagle3.acceptance import Acceptance
from tracediff.jsonio import dumps, loads_versioned
from tracediff.trace.completeness import Gap

REPORT_VERSION = 8  # 7: acceptance.chains_unscored, text_edit; 8: acceptance.server_verifies/accept_len

Verdict = Literal["match", "diverged", "incomplete", "incomparable"]
EXIT_CODES: dict[str, int] = {"match": 0, "diverged": 1, "incomparable": 2, "incomplete": 3}

Status = Literal[
    "match",  # every aligned row within tolerance
    "diverged",  # holds the first divergence
    "downstream",  # fails too, after the first divergence
    "unchecked",  # --stop-at-first stopped before its last rows
    "not_comparable",  # no row could be compared (see coverage)
    "shape_mismatch",  # row shapes differ between the sides
    "dtype_mismatch",  # integer on one side, float on the other: compared by value, never a match
    "mixed_records",  # a side's records of this name differ in dtype or shape, or are static and per-token
    "missing_in_a",
    "missing_in_b",
]
# Statuses that keep a tensor present on both sides from a match without a divergence (rows not
# compared, or compared across kinds of dtype): the verdict is at best incomplete.
INCOMPLETE_STATUSES = ("not_comparable", "shape_mismatch", "dtype_mismatch", "mixed_records")

Reason = Literal[
    "padding",  # a padded row (position -1): never compared
    "prefix_unknown",  # the tokens before the row's position are not in the trace
    "token_conflict",  # the row's token differs from its request's known token there
    "outside_shared_prefix",  # the other side never saw this token prefix
    "not_recorded",  # the other side knows the tokens but recorded no such row
    "filtered_step",  # the other side's recorder kept only every N-th step (--align step)
    "fed_differs",  # depth > 0: the draft was fed other tokens on the two sides
    "fed_unknown",  # a draft row whose fed token is not known (no draft.input_ids, next token unknown)
    "past_other_text",  # depth > 0: fed a token past the other side's text (it cannot hold the row)
    "shape_mismatch",
    "mixed_records",
]
# Rows left out by design, not for want of data: they do not count against coverage.
EXCUSED: tuple[str, ...] = ("padding", "fed_differs", "past_other_text")
REASON_TEXT: dict[str, str] = {
    "padding": "padding",
    "prefix_unknown": "prefix unknown",
    "token_conflict": "token differs from the request's known token",
    "outside_shared_prefix": "outside the shared token prefix",
    "not_recorded": "not recorded on the other side",
    "filtered_step": "step filtered out on the other side",
    "fed_differs": "not comparable at depth > 0 (fed other tokens)",
    "past_other_text": "draft rows past the other side's text",
    "fed_unknown": "fed tokens unknown (no draft.input_ids, and the next token is not in the token table)",
    "shape_mismatch": "shape mismatch",
    "mixed_records": "records of mixed kinds (dtype, row shape, or static and per-token)",
}

@dataclass
class Coverage:
    """Rows of one tensor (or of all tensors) on each side, how many were compared, and why the
    others were not. ``aligned`` counts pairs compared (a row with copies on the other side is in
    several); ``compared_a`` / ``compared_b`` count each side's distinct rows compared.
    ``fraction`` = the compared share of the comparable rows (rows minus ``EXCUSED`` reasons) of the
    side with fewer comparable rows (the lower share on a tie); None when that side has none. For
    all tensors together, ``fraction`` is the least-covered tensor's. ``depths``: the same per draft
    depth either side recorded (each with its ``depth``), so that no depth hides behind another's
    rows; ``depth`` is None for a coverage over all depths."""

    rows_a: int = 0
    rows_b: int = 0
    aligned: int = 0
    compared_a: int = 0
    compared_b: int = 0
    skipped_a: dict[str, int] = field(default_factory=dict)
    skipped_b: dict[str, int] = field(default_factory=dict)
    fraction: float | None = None
    depth: int | None = None
    depths: list[Coverage] = field(default_factory=list)

    @classmethod
    def of(cls, rows: tuple[int, int], aligned: int, compared: tuple[int, int], skipped_a: dict[str, int],
           skipped_b: dict[str, int], depth: int | None = None,
           depths: list[Coverage] | None = None) -> Coverage:
        skipped = (skipped_a, skipped_b)
        eligible = [n - sum(s.get(r, 0) for r in EXCUSED) for n, s in zip(rows, skipped)]
        shares = [done / n if n > 0 else None for done, n in zip(compared, eligible)]
        smaller = [s for s, n in zip(shares, eligible) if n == min(eligible) and s is not None]
        return cls(rows[0], rows[1], aligned, compared[0], compared[1], _nonzero(skipped_a),
                   _nonzero(skipped_b), min(smaller) if smaller else None, depth, list(depths or []))

    @classmethod
    def total(cls, parts: list[Coverage], depth: int | None = None) -> Coverage:
        def summed(side: str) -> dict[str, int]:
            out: dict[str, int] = {}
            for p in parts:
                for reason, n in getattr(p, side).items():
                    out[reason] = out.get(reason, 0) + n
            return out

        shares = [0.0 if p.fraction is None and not p.aligned else p.fraction for p in parts]
        known = [s for s in shares if s is not None]
        by_depth: dict[int, list[Coverage]] = {}
        for p in parts:
            for d in p.depths:
                by_depth.setdefault(d.depth if d.depth is not None else 0, []).append(d)
        return cls(sum(p.rows_a for p in parts), sum(p.rows_b for p in parts), sum(p.aligned for p in parts),
                   sum(p.compared_a for p in parts), sum(p.compared_b for p in parts), summed("skipped_a"),
                   summed("skipped_b"), min(known) if known else None, depth,
                   [cls.total(by_depth[d], d) for d in sorted(by_depth)])

    @property
    def one_sided(self) -> str | None:
        """"a" / "b" when only that side holds rows here, else None."""
        if self.rows_a and not self.rows_b:
            return "a"
        return "b" if self.rows_b and not self.rows_a else None

    def describe(self) -> str:
        """One line: '12 / 12 of 33 / 12 rows compared (100%); not compared: a 21 outside the shared
        prefix'."""
        pct = "" if self.fraction is None else f" ({100 * self.fraction:.0f}%)"
        line = f"{self.compared_a} / {self.compared_b} of {self.rows_a} / {self.rows_b} rows compared{pct}"
        skipped = [f"{side} {n} {REASON_TEXT.get(r, r)}" for side, reasons in
                   (("a", self.skipped_a), ("b", self.skipped_b)) for r, n in reasons.items()]
        return line + ("; not compared: " + ", ".join(skipped) if skipped else "")


@dataclass
class RowRef:
    """One row on both sides: where it is and (for a failing row) its metrics."""

    request_a: str
    request_b: str
    position: int
    depth: int
    step_a: int
    step_b: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Profile:
    """Error of one tensor's compared rows per (draft depth, position cell), for heatmaps and error
    curves: columns, one entry per cell, sorted by (depth, position). A cell spans ``bucket``
    positions, so a profile holds at most ``MAX_CELLS`` cells per depth whatever the trace length."""

    bucket: int  # positions per cell
    depth: list[int] = field(default_factory=list)
    position: list[int] = field(default_factory=list)  # the cell's first position
    rows: list[int] = field(default_factory=list)  # row pairs compared in the cell
    failed: list[int] = field(default_factory=list)  # of them out of tolerance
    cosine: list[float | None] = field(default_factory=list)  # lowest in the cell; None for integers
    rel_l2: list[float | None] = field(default_factory=list)  # highest in the cell; None for integers


@dataclass
class TensorResult:
    name: str  # as the baseline (a) calls it
    status: Status
    dtypes: tuple[str, str] | None = None
    shapes: tuple[list[int], list[int]] | None = None  # row shapes
    rows: int = 0  # rows compared
    failed: int = 0
    coverage: Coverage | None = None
    worst: dict[str, float] = field(default_factory=dict)
    first_bad: RowRef | None = None
    note: str = ""  # e.g. the likely cause of a shape mismatch; "; " between several
    profile: Profile | None = None  # None: no row compared
    static: bool = False  # a static record (log_static), compared whole as one row: no profile by nature

    def add_note(self, text: str) -> None:
        """Append ``text`` to the note, once (chunks of a tensor find the same things again)."""
        if text and text not in self.note.split("; "):
            self.note = f"{self.note}; {text}" if self.note else text


@dataclass
class FirstDivergence:
    name: str
    row: RowRef


@dataclass
class TokenMismatch:
    """Where a target request's tokens first leave every baseline request."""

    request_a: str
    request_b: str
    position: int
    token_a: int
    token_b: int
    requests_differing: int  # requests of b whose tokens leave a somewhere


@dataclass
class TextEdit:
    """A request of b that is a request of a's text with a small edit (``diff/edits.py``): both
    recorded the text there, and it differs. ``tokens_a`` / ``tokens_b``: each side's tokens in the
    edit (one empty: a token added on the other side); ``token_a`` / ``token_b``: each side's token at
    ``position``."""

    request_a: str
    request_b: str
    position: int
    token_a: int
    token_b: int
    tokens_a: list[int]
    tokens_b: list[int]
    requests: int  # requests of b whose text is an edit of a request of a
    every_request: bool  # every request of b holds this same edit at this same position

    def line(self, labels: tuple[str, str]) -> str:
        """The edit in one line, naming the sides by ``labels`` (the verdict's first reason)."""
        a, b = labels
        if not self.tokens_a:
            what = f"{b} has an extra token {self.tokens_b[0]}" if len(self.tokens_b) == 1 else \
                f"{b} has {len(self.tokens_b)} extra tokens {self.tokens_b}"
        elif not self.tokens_b:
            what = f"{b} lacks {a}'s token {self.tokens_a[0]}" if len(self.tokens_a) == 1 else \
                f"{b} lacks {a}'s tokens {self.tokens_a}"
        elif len(self.tokens_a) == len(self.tokens_b) == 1:
            what = f"{b} has token {self.token_b} where {a} has {self.token_a}"
        else:
            what = f"{b} has tokens {self.tokens_b} where {a} has {self.tokens_a}"
        if self.every_request:
            start = " (a BOS that one side's chat template adds?)" if self.position == 0 and \
                not (self.tokens_a and self.tokens_b) else ""
            return f"{what} at position {self.position} of every request{start}"
        more = f"; {self.requests} requests differ so" if self.requests > 1 else ""
        return (f"{what} at position {self.position} of request {self.request_b} ({a}'s request "
                f"{self.request_a} but for that{more})")


@dataclass
class TokenView:
    """One request's tokens on both sides, clipped to at most ``MAX_TOKENS`` around the first token
    that differs (or around the first divergence's position when the tokens agree), for a reader
    to see what each side was fed."""

    request_a: str
    request_b: str
    start: int  # position of tokens_a[0] and tokens_b[0]
    tokens_a: list[int]
    tokens_b: list[int]
    first_difference: int | None  # position of the first differing token; None: the shown tokens agree
    focus: int | None  # position of the first divergence's row, if any


@dataclass
class Shortfall:
    """Where an ``incomplete`` verdict falls short: the tensors compared too little, and the request
    pair holding most of their rows the other side lacks (for a bundle's slices)."""

    tensors: list[str] = field(default_factory=list)  # a's names, as the report orders them
    requests: tuple[str, str] | None = None  # (a's, b's) request holding the most lacking rows
    position: int = 0  # the lacking row nearest to a row both sides hold, in that pair
    spots: list[tuple[int, int]] = field(default_factory=list)  # (first, last) position kept per side


@dataclass
class ContractEntry:
    key: str
    a: Any
    b: Any


@dataclass
class ContractDiff:
    """Run-contract keys whose values differ, and keys only one side states (not a difference)."""

    differing: list[ContractEntry] = field(default_factory=list)
    only_a: dict[str, Any] = field(default_factory=dict)
    only_b: dict[str, Any] = field(default_factory=dict)
    # what both sides resolved to the same value (contract.AGREEING: the aux states fed), so that a
    # difference in what it is resolved from (the aux ids, read per target family) is told apart
    agreeing: dict[str, Any] = field(default_factory=dict)


@dataclass
class TraceInfo:
    """Who produced a trace, for the report's reader and the bug report."""

    paths: list[str]
    source: str = ""
    producer: str = ""
    producer_version: str = ""
    format_version: int = 0
    created: str = ""
    torch: str = ""
    device: str = ""
    closed: bool = True  # False: the writer never closed (killed?); rows after its last flush are lost
    world_size: int = 1  # ranks of the run; more than ``paths`` means rank files are missing
    row_keys: str = ""  # the contract's: "step_position" / "mixed" when rows lack token ids
    acceptance: Acceptance | None = None  # its recorded drafts against its target tokens (acceptance.py)
    # what this trace lacks of what its run logged (trace/completeness.py), where it costs the verdict
    # (a stop, a writer never closed, rank files missing, records dropped or never recorded of a tensor
    # the other side holds): the verdict is at best incomplete
    gaps: list[Gap] = field(default_factory=list)
    gaps_ignored: list[Gap] = field(default_factory=list)  # the same of tensors the other side lacks too
    filtered: list[str] = field(default_factory=list)  # the user's recording filters: "exclude=a,b"


@dataclass(kw_only=True)
class Report:
    report_version: int = REPORT_VERSION
    verdict: Verdict
    reasons: list[str]  # why the verdict is incomplete / incomparable, one line each
    a: TraceInfo
    b: TraceInfo
    align: Literal["prefix", "step"]
    min_coverage: float
    coverage: Coverage
    first_divergence: FirstDivergence | None
    diagnoses: list[Diagnosis]
    tensors: list[TensorResult]
    contract: ContractDiff
    token_mismatch: TokenMismatch | None
    # where both sides recorded a request's text and it differs: a verdict of diverged (or incomparable)
    text_edit: TextEdit | None = None
    tokens: TokenView | None = None
    renamed: dict[str, str] = field(default_factory=dict)  # name in b -> name in a (--map), where they differ
    same_file: bool = False  # a and b are the same files (device and inode): a trace compared with itself
    same_target: bool = False  # the user declared the targets the same model (--same-target)
    shortfall: Shortfall | None = None  # an incomplete verdict's: where it falls short

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self, indent: int | None = 1) -> str:
        return dumps(self, indent)

    @classmethod
    def from_json(cls, text: str) -> Report:
        """The report ``to_json`` wrote; ValueError for another report version or shape."""
        return loads_versioned(cls, text, "report_version", REPORT_VERSION, "report")


def side_labels(a: TraceInfo, b: TraceInfo) -> tuple[str, str]:
    """How a verdict line names each side: its ``source`` ("training", "serving") where the two
    differ, else "a" and "b"."""
    return (a.source, b.source) if a.source and b.source and a.source != b.source else ("a", "b")


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: int(v) for k, v in counts.items() if v}
