"""Replay: run a draft checkpoint offline on the target tensors a trace recorded.

The standalone check every engineer writes by hand when acceptance is low: feed the draft what
the server fed it (recorded ``draft.fc_in``) or what training fed it (aux rebuilt from recorded
``target.layer.*`` under an ``AuxSpec``), teacher-forced, and score it against the recorded
target tokens. A fc input built from the wrong layers shows up as an accuracy collapse.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tracediff.eagle3.canonical import RowLogger
from tracediff.eagle3.capture import AuxSpec
from tracediff.eagle3.chains import drafted_from, leading_hits, tree_shape
from tracediff.eagle3.checkpoint import nonfinite
from tracediff.eagle3.config import DraftConfig
from tracediff.eagle3.draft import DepthResult, Eagle3Draft, to_target_fn
from tracediff.eagle3.draft_summary import draft_config_summary
from tracediff.eagle3.names import (
    DRAFT_FC_IN,
    DRAFT_INPUT_IDS,
    DRAFT_POSITIONS,
    TARGET_TOKEN,
    VERIFY_ACCEPT_LEN,
)
from tracediff.eagle3.readings import READINGS, EngineChoice, differences
from tracediff.eagle3.selfcheck import RecordedChains, SelfCheck
from tracediff.errors import InputError
from tracediff.jsonio import to_plain
from tracediff.record.recorder import Recorder
from tracediff.trace.dtypes import decode
from tracediff.trace.reader import RowKeys, TensorRows, Trace

RECORDED = "recorded draft.fc_in"
DEFAULT_DEPTHS = 4  # a chain's depths when the trace says nothing of the server's or the training's


class DepthChoice(NamedTuple):
    """How many draft depths a replay unrolls, and why that many."""

    depths: int
    reason: str


def chain_depths(trace: Trace, asked: int | None = None) -> DepthChoice:
    """The depths to replay: as ``asked``; else the server's resolved ``speculative_num_steps`` (the
    chain it drafted before each verify); else one more than the deepest draft depth the trace
    recorded (a training trace: its TTT length); else ``DEFAULT_DEPTHS``."""
    if asked is not None:
        return DepthChoice(asked, "--depths")
    steps = (trace.speculative_args or {}).get("num_steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        return DepthChoice(steps, f"the trace's speculative num_steps {steps}")
    idx = trace.index
    drafted = idx.depth[np.char.startswith(idx.name.astype(str), "draft.")] if len(idx) else idx.depth
    if len(drafted):
        deepest = int(drafted.max())
        return DepthChoice(deepest + 1, f"the trace's recorded draft depths 0-{deepest}")
    return DepthChoice(DEFAULT_DEPTHS, "the default: the trace records neither num_steps nor draft depths")


class DepthBound(NamedTuple):
    """The most draft depths one input can hold, the file that sets it, and why."""

    depths: int
    source: str
    why: str


def trace_depth_bound(trace: Trace) -> DepthBound | None:
    """What a trace can score: depth d of row t is scored against the target's token at t+1+d, so
    where the last recorded ``target.token`` of any request is at position L, no row has a label at
    depth L or deeper (row 0's deepest is L-1): a chain of more than L depths scores nothing at the
    rest. None where it records no target token past position 0 (replay says so itself)."""
    if TARGET_TOKEN not in trace.names():
        return None
    positions = trace.keys(TARGET_TOKEN).position
    last = int(positions.max()) if len(positions) else 0
    if last <= 0:
        return None
    return DepthBound(last, trace.name, f"its requests record the target's token up to position {last} at "
                                        "most, and depth d of row t is scored against the target's token at "
                                        f"t+1+d: no row has one at depth {last} or deeper")


def draft_depth_bound(config: DraftConfig) -> DepthBound:
    """What a draft can compute: depth d of a row is rotated to its position + d, and the draft was
    built for positions below ``max_position_embeddings`` (engines size their RoPE tables by it)."""
    limit = config.max_position_embeddings
    return DepthBound(limit, config.source or "the draft's config.json",
                      f"max_position_embeddings is {limit}, and depth d of a row is rotated to its position "
                      "+ d: a deeper chain leaves the positions the draft was built for")


def bounded(choice: DepthChoice, bounds: Iterable[DepthBound | None]) -> DepthChoice:
    """``choice`` where no bound is below it; else ``InputError`` naming the file of the tightest
    bound (checked before anything is sized by the depths: 10**9 of them would not fit in memory)."""
    tightest = min((b for b in bounds if b is not None), key=lambda b: b.depths, default=None)
    if tightest is not None and choice.depths > tightest.depths:
        raise InputError(tightest.source, f"a chain of {choice.depths} draft depths ({choice.reason}) is "
                                          f"deeper than the {tightest.depths} it can hold: {tightest.why}")
    return choice


@dataclass(frozen=True)
class FcRows:
    """Where one request's fc input lies in a trace, read only when asked (``read``): a replay holds
    one request's tensor rows at a time, whatever the size of the trace. Per source tensor (their
    rows concatenated in this order to the fc input), its keys and the row of each position."""

    trace: Trace
    keys: tuple[RowKeys, ...]
    rows: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return len(self.rows[0])

    @property
    def width(self) -> int:
        return sum(int(np.prod(k.row_shape, dtype=np.int64)) for k in self.keys)

    def head(self, n: int) -> FcRows:
        return FcRows(self.trace, self.keys, tuple(r[:n] for r in self.rows))

    def then(self, rest: FcRows) -> FcRows:
        """These rows followed by ``rest``'s (the same sources)."""
        joined = tuple(np.concatenate([mine, theirs]) for mine, theirs in zip(self.rows, rest.rows))
        return FcRows(self.trace, self.keys, joined)

    def read(self) -> np.ndarray:
        """[rows, K*H] float32: each source's rows, decoded, side by side."""
        parts = [decode(self.trace.gather(k, r), k.dtype).reshape(len(r), -1).astype(np.float32, copy=False)
                 for k, r in zip(self.keys, self.rows)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)


@dataclass
class RequestRows:
    """One request's depth-0 rows, by position: where its fc input lies, fed tokens, target tokens."""

    request: str
    positions: np.ndarray
    tokens: np.ndarray  # x[t] at each position
    fc: FcRows  # [R, K*H] once read
    next_tokens: np.ndarray  # x[t+1]: what row t embeds
    target_at: dict[int, int]  # position -> the target's prediction there, for every recorded row
    rope_positions: np.ndarray  # the positions the draft rotated row t by (recorded draft.positions, else t)

    def labels(self, depth: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(label, has_label) for the first ``rows`` rows at ``depth``: the target token at t + 1 + depth."""
        wanted = [self.target_at.get(int(p) + 1 + depth, -1) for p in self.positions[:rows]]
        labels = np.array(wanted, dtype=np.int64)
        return labels, labels >= 0


@dataclass(frozen=True)
class ReplayReport:
    """What a replay measured. ``expected_accept_len`` is scored on ``scored_on``: on a serving trace
    the chains the server drafted (each request's rows it drafted from, the ones its trace holds
    draft depths >= 1 at), else every row (a training trace: TTT drafts from every row). A chain is
    scored when every depth of it has a recorded target token (``chains.leading_hits``);
    ``chains_unscored``: the others (a chain reaching past the recorded text). ``every_row_accept_len``
    is the same figure teacher-forced from every row, prompt rows included (``every_row_chains``)."""

    aux: str
    requests: int
    depth_accuracy: list[float] = field(default_factory=list)
    depth_rows: list[int] = field(default_factory=list)
    expected_accept_len: float = 1.0
    depths_from: str = "--depths"  # why the chain has this many depths (``chain_depths``)
    scored_on: str = "every row"  # "the server's chains" or "every row"
    chains: int = 0
    chains_unscored: int = 0
    every_row_accept_len: float = 1.0
    every_row_chains: int = 0
    self_check: SelfCheck | None = None  # the recorded chains replayed with their own inputs (serving)
    engine: str = ""  # whose reading of the draft config the replay computed ("SGLang 0.5.23")
    engine_from: str = ""  # why that one (``engine_choice``)
    not_the_servers: str | None = None  # why the figure is not the server's chains' (a tree), if it is not
    engine_notes: list[str] = field(default_factory=list)  # how the loader completed it, as the engine does
    # requests left out: their rows start past position 0 and no recorded request holds the rows before
    # (a prefix-cache hit on rows computed for a request the trace lacks); replayed without them, the
    # draft would attend to nothing there, unlike the server's
    requests_without_context: list[str] = field(default_factory=list)
    # the server's own verify (recorded verify.accept_len) over the chains the figure rests on, where
    # recorded: 1 + the drafts it accepted, and how many of those chains record it
    verified_accept_len: float | None = None
    verified_chains: int = 0
    server_num_steps: int | None = None  # the chain the server drafted (its speculative num_steps), if stated

    def to_dict(self) -> dict:
        """Strict JSON as every report of tracediff writes it (``jsonio.py``): an accuracy over 0
        rows is the string "NaN"."""
        return to_plain(self)


def by_position(rows: TensorRows | RowKeys) -> dict[str, dict[int, int]]:
    """Per request, the row index of each depth-0 position (the last occurrence wins, e.g. a
    re-extend): one pass over the key columns, whatever the number of requests."""
    out: dict[str, dict[int, int]] = {}
    picked = np.flatnonzero(rows.depth == 0)
    for i, request, position in zip(picked.tolist(), rows.request[picked].tolist(),
                                    rows.position[picked].tolist()):
        out.setdefault(request, {})[position] = i
    return out


def request_rows(trace: Trace, aux: AuxSpec | None) -> Iterator[RequestRows]:
    """Depth-0 rows per request, in position order from position 0, where every input the draft
    needs was recorded. A request whose first rows the server took from its prefix cache (rows
    another request computed) borrows them from the request it shares those tokens with: the
    server's draft attended to them too. Rows need no target token (prompt rows: their fc input
    is context); they are scored where the target's token is recorded."""
    targets = trace.rows(TARGET_TOKEN)
    fed = trace.rows(DRAFT_INPUT_IDS, depth=0) if DRAFT_INPUT_IDS in trace.names() else None
    rope = trace.rows(DRAFT_POSITIONS, depth=0) if DRAFT_POSITIONS in trace.names() else None
    wanted = aux.sources() if aux else [DRAFT_FC_IN]
    lacking = [name for name in wanted if name not in trace.names()]
    if lacking:
        raise InputError(trace.paths[0], f"the trace holds no {', '.join(lacking)}"
                                         + (" (the fc input --aux rebuilds needs them)" if aux else ""))
    sources = [trace.keys(name) for name in wanted]  # where the rows lie; read per request
    source_at = [by_position(keys) for keys in sources]
    target_by, fed_by = by_position(targets), by_position(fed) if fed is not None else {}
    rope_by = by_position(rope) if rope is not None else {}
    texts = trace.request_tokens()
    known = {r for r in texts.requests()} if len(texts) else set()
    done: dict[str, RequestRows] = {}
    for request in dict.fromkeys(targets.request.tolist()):
        target_at = target_by.get(request, {})
        fed_at, rope_at = fed_by.get(request, {}), rope_by.get(request, {})
        at = [found.get(request, {}) for found in source_at]
        text = dict(zip(*(a.tolist() for a in texts.sequence(request)))) if request in known else {}
        text.update({p: int(targets.token_id[i]) for p, i in target_at.items()})
        # position -1 keys rows that are no position (padding, a row fed past the text's end)
        positions = sorted(p for p in set.intersection(*(set(a) for a in at)) if p >= 0)
        usable = [p for p in positions if p in fed_at or p + 1 in text]
        if not usable:
            continue
        fc = FcRows(trace, tuple(sources), tuple(np.array([found[p] for p in usable], dtype=np.int64)
                                                 for found in at))
        nxt = np.array([int(fed.data[fed_at[p]]) if fed is not None and p in fed_at else text[p + 1]
                        for p in usable])
        rotated = np.array([int(rope.data[rope_at[p]]) if rope is not None and p in rope_at else p
                            for p in usable], dtype=np.int64)
        own = RequestRows(request=request, positions=np.array(usable), tokens=np.array(
            [text.get(p, -1) for p in usable]), fc=fc, next_tokens=nxt,
            target_at={p: int(targets.data[i]) for p, i in target_at.items()}, rope_positions=rotated)
        done[request] = own = _with_cached_prefix(own, text, done)
        yield own


def _with_cached_prefix(own: RequestRows, text: dict[int, int], done: dict[str, RequestRows]) -> RequestRows:
    """``own`` preceded by the rows 0 .. first-1 of an earlier request whose text agrees at
    positions 0 .. first-1 (a prefix cache hit: the target's states there, and so the fc input,
    depend on those tokens alone and were computed once, for it). Each borrowed row is fed the next
    token of ``own``'s text (the last one its x[first], which the donor's text may not share); a
    donor that agrees at ``first`` too is taken first. ``own`` unchanged when no recorded request
    holds those rows (``replay`` then leaves it out: its context is missing)."""
    first = int(own.positions[0])
    if first == 0:
        return own
    agreeing = []
    for donor in done.values():
        lead = np.flatnonzero(donor.positions < first)
        if len(lead) != first or not (donor.positions[:first] == np.arange(first)).all():
            continue
        if any(text.get(p) != int(t) for p, t in zip(range(first), donor.tokens[:first])):
            continue
        agreeing.append(donor)
    if not agreeing:
        return own
    donor = next((d for d in agreeing if text.get(first) == int(d.next_tokens[first - 1])), agreeing[0])
    fed = donor.next_tokens[:first].copy()
    fed[first - 1] = text.get(first, int(fed[first - 1]))
    return RequestRows(request=own.request,
                       positions=np.concatenate([donor.positions[:first], own.positions]),
                       tokens=np.concatenate([donor.tokens[:first], own.tokens]),
                       fc=donor.fc.head(first).then(own.fc),
                       next_tokens=np.concatenate([fed, own.next_tokens]),
                       target_at=own.target_at,
                       rope_positions=np.concatenate([donor.rope_positions[:first], own.rope_positions]))


def contiguous_rows(positions: np.ndarray) -> int:
    """How many leading rows hold consecutive positions (a chain's context has no gap)."""
    gaps = np.flatnonzero(np.diff(positions) != 1)
    return int(gaps[0]) + 1 if len(gaps) else len(positions)


class Scored(NamedTuple):
    """A teacher-forced unroll over n rows: per row and depth, whether the draft's token is the
    target's (``hits``) and whether the target's token is known there (``valid``)."""

    hits: np.ndarray  # [n, depths] bool
    valid: np.ndarray  # [n, depths] bool
    results: list[DepthResult]


def teacher_forced(draft: Eagle3Draft, fc_in: np.ndarray, ids: np.ndarray, positions: np.ndarray, depths: int,
                   labels, to_target) -> Scored:
    """Unroll ``depths`` depths over rows fed ``ids`` (row t embeds x[t+1], shifted left per depth),
    scored against ``labels(depth, rows) -> (label, known)`` after ``to_target``. Row t at depth d
    is fed x[t+1+d]: scored only for t + d < n."""
    n = len(ids)
    with torch.no_grad():
        results = draft.unroll(torch.from_numpy(fc_in[None]), torch.from_numpy(ids[None]), depths,
                               positions=torch.from_numpy(positions[None]))
    hits = np.zeros((n, depths), dtype=bool)
    valid = np.zeros((n, depths), dtype=bool)
    for depth, result in enumerate(results):
        rows = n - depth
        if rows <= 0:
            continue
        label, known = labels(depth, rows)
        predicted = to_target(result.logits[0, :rows].argmax(-1)).numpy()
        hits[:rows, depth] = (predicted == label) & known
        valid[:rows, depth] = known
    return Scored(hits, valid, results)


def _check_width(width: int, draft: Eagle3Draft, sources: str) -> None:
    """The fc input must be as wide as the draft's fc takes (a slot more or less is not replayable)."""
    takes = draft.fc.in_features
    if width != takes:
        hidden = draft.config.target_hidden
        raise InputError("--aux" if sources != RECORDED else DRAFT_FC_IN,
                         f"the fc input ({sources}) is {width} wide ({width / hidden:g} slots of {hidden}); "
                         f"the draft's fc takes {takes} ({takes // hidden} slots)")


@dataclass
class Tally:
    """What replaying the requests adds up, request by request (``replay`` builds its report from it)."""

    depths: int
    correct: list[int] = field(default_factory=list)  # per depth: rows whose draft matched
    total: list[int] = field(default_factory=list)  # per depth: rows scored
    leading: list[int] = field(default_factory=list)  # every row's chain, scored
    unscored: int = 0  # every row's chains left unscored
    chained: list[int] = field(default_factory=list)  # the chains the server drafted
    verified: list[int] = field(default_factory=list)  # the server's own accepted drafts at those scored
    requests: int = 0

    def __post_init__(self) -> None:
        self.correct, self.total = [0] * self.depths, [0] * self.depths


def replay(trace: Trace, draft: Eagle3Draft, depths: int | None = None, aux: AuxSpec | None = None,
           d2t_reading: str = "offset", rec: Recorder | None = None,
           engine: EngineChoice | None = None,
           progress: Callable[[int, int], None] | None = None) -> ReplayReport:
    """Teacher-forced accuracy per depth and expected accept length of a chain of ``depths`` drafts
    (default: ``chain_depths``), the draft computed as ``engine`` reads its config (``draft`` was
    loaded under that reading). A trace where no row can be scored (no draft row whose next
    position holds a target token) is an ``InputError``, never a figure over 0 rows. ``progress(done,
    total)`` hears the rows replayed."""
    choice = bounded(chain_depths(trace, depths), (trace_depth_bound(trace), draft_depth_bound(draft.config)))
    tree = tree_shape(trace)
    anchors = drafted_from(trace) if tree is None else {}
    if tree is None and not anchors and trace.speculative_args is not None:
        tree = ("the trace records none of the server's chains (no draft rows at depth 1, nor a one-step "
                "server's draft.token_target): the figure is the teacher-forced chain from every row")
    recorded = RecordedChains(trace) if anchors else None
    own_inputs = aux is None  # the self-check replays the trace's own inputs, never --aux's
    check = SelfCheck() if own_inputs and recorded is not None and recorded.usable else None
    label = ", ".join(aux.sources()) if aux else RECORDED
    every = list(request_rows(trace, aux))  # keys and tokens: no tensor data yet
    requests = [r for r in every if r.positions[0] == 0]
    if every and not requests:
        raise InputError(trace.paths[0], f"replay has no request with its context: the rows of all "
                                         f"{len(every)} start past position 0 and no recorded request holds "
                                         "the rows before (prefix-cache hits on rows computed for requests "
                                         "the trace lacks)")
    tally = _replay_requests(trace, draft, requests, Tally(choice.depths), label, anchors, recorded, check,
                             to_target_fn(draft, d2t_reading), rec, progress)
    if not tally.total or not tally.total[0]:
        raise InputError(trace.paths[0], f"replay has no row to score: no row of {label} has the "
                                         "target's token at its next position recorded (target.token); a "
                                         "training trace needs them recorded too")
    if check is not None and check.first_departure is not None and engine is not None:
        check.suspect = _suspect(draft, engine, trace)
    server_scored = [k for k in tally.chained if k >= 0]
    if anchors and not server_scored:
        raise InputError(trace.paths[0], f"replay has no server chain to score: all {len(tally.chained)} of "
                                         "them reach past the recorded text (the target's tokens after them "
                                         "are not recorded); record more new tokens per request")
    every_row = 1 + (float(np.mean(tally.leading)) if tally.leading else 0.0)
    steps = (trace.speculative_args or {}).get("num_steps")
    return ReplayReport(
        aux=label, requests=tally.requests,
        depth_accuracy=[c / t if t else float("nan") for c, t in zip(tally.correct, tally.total)],
        depth_rows=tally.total,
        expected_accept_len=1 + float(np.mean(server_scored)) if anchors else every_row,
        depths_from=choice.reason, scored_on="the server's chains" if anchors else "every row",
        chains=len(server_scored) if anchors else len(tally.leading),
        chains_unscored=len(tally.chained) - len(server_scored) if anchors else tally.unscored,
        every_row_accept_len=every_row, every_row_chains=len(tally.leading), self_check=check,
        engine="" if engine is None else engine.reading.label,
        engine_from="" if engine is None else engine.reason, not_the_servers=tree,
        engine_notes=list(draft.notes),
        requests_without_context=[r.request for r in every if r.positions[0] != 0],
        verified_accept_len=1 + float(np.mean(tally.verified)) if anchors and tally.verified else None,
        verified_chains=len(tally.verified) if anchors else 0,
        server_num_steps=steps if isinstance(steps, int) and not isinstance(steps, bool) else None)


def _replay_requests(trace: Trace, draft: Eagle3Draft, requests: list[RequestRows], tally: Tally, label: str,
                     anchors: dict[str, set[int]], recorded: RecordedChains | None, check: SelfCheck | None,
                     to_target: Callable, rec: Recorder | None,
                     progress: Callable[[int, int], None] | None) -> Tally:
    """Replay each request's rows (one request's tensors in memory at a time), adding to ``tally``; the
    recorded chains replayed with their own inputs into ``check``; the replayed tensors to ``rec``."""
    depths = tally.depths
    verify_rows = trace.rows(VERIFY_ACCEPT_LEN) if VERIFY_ACCEPT_LEN in trace.names() else None
    verify = by_position(verify_rows) if verify_rows is not None else {}
    verify_values = verify_rows.numpy().reshape(-1) if verify_rows is not None else np.zeros(0)
    planned, replayed = sum(contiguous_rows(r.positions) for r in requests), 0
    for req in requests:
        _check_width(req.fc.width, draft, label)
        tally.requests += 1
        n = contiguous_rows(req.positions)
        fc_in = req.fc.head(n).read()  # one request's rows in memory at a time
        ids = req.next_tokens[:n]  # row t embeds x[t+1]; unroll shifts them left at each depth
        scored = teacher_forced(draft, fc_in, ids, req.rope_positions[:n], depths, req.labels, to_target)
        hits, valid = scored.hits, scored.valid
        for depth, result in enumerate(scored.results):
            tally.correct[depth] += int(hits[:, depth].sum())
            tally.total[depth] += int(valid[:, depth].sum())
            if n - depth > 0:
                _log_depth(rec, req, fc_in, result, ids, n - depth, depth, to_target)
        lead = leading_hits(hits, valid)
        tally.leading += lead[lead >= 0].tolist()
        tally.unscored += int((lead < 0).sum())
        drafted = np.isin(req.positions[:n], sorted(anchors.get(req.request, ())))
        tally.chained += lead[drafted].tolist()
        at = verify.get(req.request, {})
        tally.verified += [int(verify_values[at[int(p)]]) for p in req.positions[:n][drafted & (lead >= 0)]
                           if int(p) in at]
        if check is not None and recorded is not None and drafted.any():
            rows_at = np.flatnonzero(drafted)
            teacher = torch.from_numpy(ids[None])
            with torch.no_grad():
                own = draft.unroll(torch.from_numpy(fc_in[None]), teacher, depths,
                                   positions=torch.from_numpy(req.rope_positions[None, :n]),
                                   fed=recorded.fed(req.request, rows_at, req.positions[:n], teacher, depths))
            recorded.compare(check, req.request, rows_at, req.positions[:n], own, to_target)
        replayed += n
        if progress is not None:
            progress(replayed, planned)
    return tally


def config_mismatch(draft: Eagle3Draft, trace: Trace) -> str | None:
    """Where the checkpoint's config differs from the draft config the trace's producer stated
    (its contract's ``draft_config``): "rope_theta 500000.0 (the trace states 10000.0)", else None."""
    stated = trace.contract.get("draft_config")
    if not isinstance(stated, dict):
        return None
    ours = draft_config_summary(draft.config.raw)
    differ = [k for k, v in ours.items() if v is not None and stated.get(k) is not None and stated[k] != v]
    return "; ".join(f"{k} {json.dumps(ours[k])} (the trace states {json.dumps(stated[k])})"
                     for k in differ) or None


def _suspect(draft: Eagle3Draft, engine: EngineChoice, trace: Trace) -> str | None:
    """A departure's likely cause: weights holding NaN or inf (no engine computes a draft from
    them), else the checkpoint's config is not the one the trace's producer stated (its contract's
    ``draft_config``), else a key another engine reads differently."""
    broken = nonfinite(draft.state_dict())
    if broken:
        return (f"the draft's weights hold non-finite values: {'; '.join(broken)}: the draft computes NaN "
                "through them, whatever the engine's reading (tracediff doctor names them)")
    mismatch = config_mismatch(draft, trace)
    if mismatch:
        return f"the checkpoint's config.json is not the one the trace's producer ran: {mismatch}"
    others = [name for name in READINGS if READINGS[name] != engine.reading]
    for other in others:
        found = differences(draft.config, engine.reading.engine, other)
        if found:
            return (f"replayed with {engine.reading.label}'s reading of the draft config; "
                    f"{'; '.join(d.text for d in found)} (--engine {other})")
    return None


def _log_depth(rec: Recorder | None, req: RequestRows, fc_in: np.ndarray, result: DepthResult,
               ids: np.ndarray, rows: int, depth: int, to_target) -> None:
    if rec is None:
        return
    tokens = np.full(int(req.positions.max()) + 1, -1, dtype=np.int64)
    tokens[req.positions] = req.tokens
    logger = RowLogger(rec, req.request, tokens)
    sliced = DepthResult(embed=result.embed[:, :rows], hidden=result.hidden[:, :rows],
                         logits=result.logits[:, :rows],
                         fc_out=None if result.fc_out is None else result.fc_out[:, :rows])
    fed = torch.from_numpy(ids[None, depth : depth + rows])
    logger.draft(sliced, fed, req.positions[:rows].tolist(), 0, depth, to_target,
                 fc_in=torch.from_numpy(fc_in[None, :rows]) if depth == 0 else None)
