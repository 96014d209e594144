"""Explain: which of the draft's inputs costs how many accepted tokens, proven by replaying it.
The draft runs teacher-forced on A's inputs, on B's, and on each side with an input group (or two)
taken from the other; the run whose swap restores acceptance names the input that costs it.

Two traces of the same texts (training and serving, two servers) are paired request by request on
the rows whose text agrees from position 0 (the rows both sides hold). The input groups are the
fc input (``draft.fc_in``), the ids fed to the draft (``draft.input_ids``), the RoPE positions
(``draft.positions``), the vocab map (each side's recorded ``draft.d2t``, else the checkpoint's)
and the draft computation (the checkpoint, and the engine's reading of its config:
tracediff/eagle3/readings.py). Every run is scored as replay scores a trace: the server's chains
where one side is a serving trace, else every row; accept length and accuracy per depth, with the
chains each rests on. A difference counts when it exceeds twice the standard error of the
per-chain differences between the two runs (the noise of a figure over few chains).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from tracediff.diff.jsonio import dumps, loads_versioned
from tracediff.eagle3.chains import drafted_from, leading_hits, tree_shape
from tracediff.eagle3.draft import Eagle3Draft
from tracediff.eagle3.replay import (
    RequestRows,
    chain_depths,
    config_mismatch,
    contiguous_rows,
    request_rows,
    teacher_forced,
)
from tracediff.errors import InputError
from tracediff.trace.reader import Trace

EXPLANATION_VERSION = 1
Side = Literal["a", "b"]
GROUPS = ("fc_in", "input_ids", "positions", "d2t", "draft")
GROUP_NAMES = {"fc_in": "fc input", "input_ids": "fed token ids", "positions": "positions",
               "d2t": "vocab map (d2t)", "draft": "draft computation"}
VOCAB_BUFFERS = ("d2t", "t2d")  # the vocab map is its own group, not the draft computation's
MIN_CHAINS = 5  # fewer chains tell no difference from noise
NOISE_SE = 2.0  # a difference counts beyond this many standard errors of the per-chain differences
FC_RTOL, FC_ATOL = 1e-5, 1e-6  # fc inputs this close are the same input (float round-off)


class SideRows(NamedTuple):
    """One side's draft inputs over the rows a request pair shares (n rows, position order)."""

    fc_in: np.ndarray  # [n, K*H] float32
    ids: np.ndarray  # [n]: the id each row was fed at depth 0
    positions: np.ndarray  # [n]: the RoPE positions it was fed


@dataclass(frozen=True)
class PairedRows:
    """A request of A and one of B whose texts agree on positions 0..n-1, with each side's inputs
    there, the target's tokens (either side's record), and the rows the server drafted from."""

    request_a: str
    request_b: str
    a: SideRows
    b: SideRows
    target_at: dict[int, int]
    chains: np.ndarray  # [n] bool: the rows scored as chains

    def labels(self, depth: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        wanted = [self.target_at.get(p + 1 + depth, -1) for p in range(rows)]
        labels = np.array(wanted, dtype=np.int64)
        return labels, labels >= 0


@dataclass
class Run:
    """One replay: which side each input group came from, and what it scored."""

    name: str  # "A's inputs", "B with A's fc input", ...
    base: Side
    swapped: list[str]  # groups taken from the other side
    expected_accept_len: float  # over the chains every run scores (``chains``): like compared with like
    chains: int
    own_accept_len: float  # over the chains this run scores (a chain reaching past the text is unscored)
    own_chains: int
    depth_accuracy: list[float]
    depth_rows: list[int]


@dataclass
class Explanation:
    """What explain measured and concluded (``to_json`` / ``from_json`` round-trip it)."""

    a: str
    b: str
    conclusion: str
    restored_by: str | None  # the run whose swap restores acceptance (``conclusion`` names it), if one does
    scored_on: str  # "the server's chains" or "every row"
    depths: int
    depths_from: str
    requests: int  # request pairs replayed
    rows: int  # rows they share
    differing: list[str]  # input groups whose values differ between the sides
    cost: float  # A's accept length - B's
    noise: float  # what a difference must exceed to count (NOISE_SE standard errors)
    runs: list[Run] = field(default_factory=list)
    recorded_agreement: dict[str, float | None] = field(default_factory=dict)  # side -> share of rows
    unpaired: dict[str, int] = field(default_factory=dict)  # side -> requests sharing no text: never replayed
    explanation_version: int = EXPLANATION_VERSION

    def run(self, name: str) -> Run:
        return next(r for r in self.runs if r.name == name)

    def to_json(self, indent: int | None = 1) -> str:
        return dumps(self, indent)

    @classmethod
    def from_json(cls, text: str) -> Explanation:
        """The explanation ``to_json`` wrote; ValueError for another version or shape."""
        return loads_versioned(cls, text, "explanation_version", EXPLANATION_VERSION, "explanation")


class Inputs(NamedTuple):
    """Everything a run draws from one side."""

    draft: Eagle3Draft
    d2t: torch.Tensor  # offsets, [draft vocab]


def explain(a: Trace, b: Trace, drafts: dict[str, Eagle3Draft], depths: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> Explanation:
    """Replay ``drafts['a']`` on A's inputs, ``drafts['b']`` on B's, and the swaps (see the module
    docstring). ``InputError`` when the traces share no scorable row."""
    pairing = paired_rows(a, b)
    pairs = pairing.pairs
    if not pairs:
        raise InputError(b.paths[0], f"shares no request text with {a.paths[0]} (no request of one agrees "
                                     "with one of the other from position 0): nothing to replay on both")
    serving = b if drafted_from(b) else a if drafted_from(a) else None
    choice = chain_depths(serving or b, depths)
    sides = {"a": Inputs(drafts["a"], _d2t(a, drafts["a"])), "b": Inputs(drafts["b"], _d2t(b, drafts["b"]))}
    differing = [g for g in GROUPS if _differs(g, pairs, sides)]
    scores: dict[str, Scores] = {}
    planned = 2 + 2 * len(differing) + math.comb(len(differing), 2)

    def add(base: Side, swapped: Sequence[str]) -> None:
        other = "b" if base == "a" else "a"
        name = f"{base.upper()}'s inputs" if not swapped else \
            f"{base.upper()} with {other.upper()}'s {' and '.join(GROUP_NAMES[g] for g in swapped)}"
        if progress is not None:
            progress(len(scores), planned)
        pick = {g: (other if g in swapped else base) for g in GROUPS}
        scores[name] = score(name, base, list(swapped), pairs, sides, pick, choice.depths)

    add("a", [])
    add("b", [])
    for group in differing:
        add("b", [group])
        add("a", [group])
    for first, second in itertools.combinations(differing, 2):
        add("b", [first, second])
    common = np.logical_and.reduce([sc.leads >= 0 for sc in scores.values()])  # chains every run scores
    runs = {name: sc.over(common) for name, sc in scores.items()}
    leads = {name: np.where(common, sc.leads, -1) for name, sc in scores.items()}
    base_a, base_b = runs["A's inputs"], runs["B's inputs"]
    if base_a.chains == 0:
        raise InputError(b.paths[0], "explain has no chain to score: the rows the traces share hold no "
                                     "target token after them")
    noise = _noise(leads["A's inputs"], leads["B's inputs"])
    cost = base_a.expected_accept_len - base_b.expected_accept_len
    agreement = {"a": _recorded_agreement(a, pairs, "a", sides["a"].d2t, scores["A's inputs"].drafted),
                 "b": _recorded_agreement(b, pairs, "b", sides["b"].d2t, scores["B's inputs"].drafted)}
    mismatch = {"a": config_mismatch(drafts["a"], a), "b": config_mismatch(drafts["b"], b)}
    unpaired = {"a": pairing.unpaired_a, "b": pairing.unpaired_b}
    verdict = conclude(runs, differing, cost, noise, leads, caveats(agreement, mismatch), unpaired)
    tree = tree_shape(serving) if serving is not None else None
    return Explanation(
        a=str(a.paths[0]), b=str(b.paths[0]), conclusion=verdict.text, restored_by=verdict.restored_by,
        depths=choice.depths, depths_from=choice.reason,
        scored_on="the server's chains" if serving is not None and tree is None else "every row",
        requests=len(pairs), rows=sum(len(p.a.ids) for p in pairs), differing=differing, cost=cost,
        noise=noise,
        runs=list(runs.values()), recorded_agreement=agreement, unpaired=unpaired)


class Pairing(NamedTuple):
    """The request pairs, and the requests of each side that share no text with the other's."""

    pairs: list[PairedRows]
    unpaired_a: int
    unpaired_b: int


def paired_rows(a: Trace, b: Trace) -> Pairing:
    """Requests of A and B paired one to one, longest agreement first: a row is shared when both
    sides hold it with the same text through the token after it (x[0..t+1]), so two conversations
    that part after a common system prompt share only the rows before they part."""
    rows_a, rows_b = list(request_rows(a, None)), list(request_rows(b, None))
    chains_a, chains_b = drafted_from(a), drafted_from(b)
    candidates = sorted(((_agree(ra, rb), i, j) for i, ra in enumerate(rows_a)
                         for j, rb in enumerate(rows_b)), key=lambda c: (-c[0], c[1], c[2]))
    taken_a, taken_b, pairs = set(), set(), []
    for shared, i, j in candidates:
        if shared == 0 or i in taken_a or j in taken_b:
            continue
        taken_a.add(i)
        taken_b.add(j)
        ra, rb = rows_a[i], rows_b[j]
        anchors = chains_b.get(rb.request) if chains_b else chains_a.get(ra.request) if chains_a else None
        positions = np.arange(shared)
        chains = np.ones(shared, bool) if not (chains_a or chains_b) else \
            np.isin(positions, sorted(anchors or ()))
        # the target's tokens: the chains' side's (B's unless only A is a server's), and the other's
        # where the texts agree (a label at p is x[p+1]): the same figures whichever trace comes first
        own, other = (ra, rb) if chains_a and not chains_b else (rb, ra)
        labels = {**{p: v for p, v in other.target_at.items() if p + 1 < shared}, **own.target_at}
        pairs.append(PairedRows(ra.request, rb.request, _side(ra, shared), _side(rb, shared), labels, chains))
    return Pairing(sorted(pairs, key=lambda p: p.request_b), len(rows_a) - len(taken_a),
                   len(rows_b) - len(taken_b))


def _agree(ra: RequestRows, rb: RequestRows) -> int:
    """How many rows from position 0 both hold with the same text through the next token, x[0..t+1]
    (the token the row should be fed; what it was fed is the fed-ids group, compared apart)."""
    n = min(contiguous_rows(ra.positions), contiguous_rows(rb.positions))
    if n == 0 or ra.positions[0] != 0 or rb.positions[0] != 0:
        return 0
    same = (_through_next(ra, n) == _through_next(rb, n)).all(axis=1)
    return int(np.argmin(same)) if not same.all() else n


def _through_next(rows: RequestRows, n: int) -> np.ndarray:
    """[n, 2]: each row's token and the text's next token (the last row's: what it was fed)."""
    nxt = np.append(rows.tokens[1:n], rows.next_tokens[n - 1])
    return np.stack([rows.tokens[:n], nxt], axis=1)


def _side(rows: RequestRows, n: int) -> SideRows:
    return SideRows(rows.fc_in[:n], rows.next_tokens[:n], rows.rope_positions[:n])


def _d2t(trace: Trace, draft: Eagle3Draft) -> torch.Tensor:
    """The vocab map the side ran: its recorded ``draft.d2t``; none at all where its server applied
    none (``vocab_map_applied`` false: draft ids are target ids); else the checkpoint's."""
    recorded = trace.last_static("draft.d2t")
    if recorded is not None and recorded.data.shape == tuple(draft.d2t.shape):
        return torch.from_numpy(np.asarray(recorded.data, dtype=np.int64))
    if trace.contract.get("vocab_map_applied") is False:
        return torch.zeros_like(draft.d2t)
    return draft.d2t


def _differs(group: str, pairs: list[PairedRows], sides: dict[str, Inputs]) -> bool:
    if group == "d2t":
        return not torch.equal(sides["a"].d2t, sides["b"].d2t)
    if group == "draft":
        da, db = sides["a"].draft, sides["b"].draft
        if da is db:
            return False
        weights_a, weights_b = (
            {k: v for k, v in d.state_dict().items() if k not in VOCAB_BUFFERS} for d in (da, db))
        same = da.numerics.forward == db.numerics.forward and weights_a.keys() == weights_b.keys() and all(
            torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
        return not same
    field_name = "ids" if group == "input_ids" else group
    for pair in pairs:
        x, y = getattr(pair.a, field_name), getattr(pair.b, field_name)
        if group == "fc_in" and not np.allclose(x, y, rtol=FC_RTOL, atol=FC_ATOL):
            return True
        if group != "fc_in" and not np.array_equal(x, y):
            return True
    return False


class Scores(NamedTuple):
    """One run's raw figures: each chain's accepted drafts (-1: unscored) and the hits per depth."""

    name: str
    base: Side
    swapped: list[str]
    leads: np.ndarray
    correct: np.ndarray  # per depth
    total: np.ndarray
    drafted: list[np.ndarray]  # per pair: the draft id each row drafted at depth 0

    def over(self, common: np.ndarray) -> Run:
        """The run's figures over the ``common`` chains (every run's), and over its own."""
        own = self.leads[self.leads >= 0]
        return Run(name=self.name, base=self.base, swapped=self.swapped,
                   expected_accept_len=1 + (float(self.leads[common].mean()) if common.any() else 0.0),
                   chains=int(common.sum()), own_accept_len=1 + (float(own.mean()) if len(own) else 0.0),
                   own_chains=len(own),
                   depth_accuracy=[c / t if t else math.nan for c, t in zip(self.correct.tolist(),
                                                                             self.total.tolist())],
                   depth_rows=self.total.tolist())


def score(name: str, base: Side, swapped: list[str], pairs: list[PairedRows], sides: dict[str, Inputs],
          pick: dict[str, str], depths: int) -> Scores:
    """One run over every pair, the inputs of each group from the side ``pick`` names."""
    draft, d2t = sides[pick["draft"]].draft, sides[pick["d2t"]].d2t

    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids + d2t[ids]

    correct, total, lead, drafted = np.zeros(depths, int), np.zeros(depths, int), [], []
    for pair in pairs:
        fc_in = getattr(pair, pick["fc_in"]).fc_in
        ids = getattr(pair, pick["input_ids"]).ids
        positions = getattr(pair, pick["positions"]).positions
        scored = teacher_forced(draft, fc_in, ids, positions, depths, pair.labels, to_target)
        correct += scored.hits.sum(axis=0)
        total += scored.valid.sum(axis=0)
        lead.append(leading_hits(scored.hits, scored.valid)[pair.chains])
        drafted.append(scored.results[0].logits[0].argmax(-1).numpy())
    leads = np.concatenate(lead) if lead else np.zeros(0, int)
    return Scores(name, base, swapped, leads, correct, total, drafted)


def _noise(x: np.ndarray, y: np.ndarray) -> float:
    """NOISE_SE standard errors of the mean per-chain difference of two runs over the same chains."""
    both = (x >= 0) & (y >= 0)
    d = (x[both] - y[both]).astype(float)
    if len(d) < MIN_CHAINS:
        return math.inf
    return NOISE_SE * float(d.std(ddof=1)) / math.sqrt(len(d)) if d.std() > 0 else 0.0


def caveats(agreement: dict[str, float | None], mismatch: dict[str, str | None]) -> list[str]:
    """What the conclusion must say first: a side whose recorded drafts the checkpoint does not
    reproduce ran another draft (its config, where the trace states one)."""
    out = []
    for side, share in agreement.items():
        if share is not None and share < 1.0:
            why = f"; the checkpoint's config has {mismatch[side]}" if mismatch[side] else ""
            option = "--draft" if side == "a" else "--draft-b"
            out.append(f"the checkpoint does not reproduce {side.upper()}'s recorded drafts ({share:.0%} of "
                       f"its depth-0 rows{why}): give {side.upper()}'s own checkpoint as {option}")
    return out


class Conclusion(NamedTuple):
    text: str
    restored_by: str | None  # the run whose swap restores acceptance, if one does


def conclude(runs: dict[str, Run], differing: list[str], cost: float, noise: float,
             leads: dict[str, np.ndarray], warnings: Sequence[str] = (),
             unpaired: dict[str, int] | None = None) -> Conclusion:
    """The one line the evidence supports, after what limits it (``warnings``: ``caveats``), and
    what it never saw (``unpaired`` requests of a side: they share no text with the other's)."""
    verdict = _verdict(runs, differing, cost, noise, leads)
    text = verdict.text
    if warnings:
        text = f"{'; '.join(warnings)}; with the checkpoints given: {text}"
    unseen = [f"{n} of {side.upper()}'s requests share no text with the other side" for side, n in
              (unpaired or {}).items() if n]
    if unseen:
        text += f" (on the request pairs only: {'; '.join(unseen)}, never replayed)"
    return Conclusion(text, verdict.restored_by)


def _groups(groups: Sequence[str]) -> str:
    return " and ".join(GROUP_NAMES[g] for g in groups)


def _verdict(runs: dict[str, Run], differing: list[str], cost: float, noise: float,
             leads: dict[str, np.ndarray]) -> Conclusion:
    a, b = runs["A's inputs"], runs["B's inputs"]
    figures = f"A {a.expected_accept_len:.2f}, B {b.expected_accept_len:.2f} over {a.chains} chains"
    if not differing:
        return Conclusion(f"A and B give the draft the same inputs ({', '.join(GROUP_NAMES.values())}): "
                          f"nothing to explain ({figures})", None)
    verb = "differs" if len(differing) == 1 else "differ"
    if math.isinf(noise):
        return Conclusion(f"too few chains to tell a difference from noise ({figures}; at least {MIN_CHAINS} "
                          f"needed); the sides' {_groups(differing)} {verb}", None)
    noise = max(noise, 0.0)
    if abs(cost) <= noise:
        return Conclusion(f"no difference in acceptance beyond the noise ({figures}; noise {noise:.2f}); the "
                          f"sides' {_groups(differing)} {verb} without costing acceptance", None)
    worse, better = ("B", "A") if cost > 0 else ("A", "B")
    low, high = (b, a) if cost > 0 else (a, b)
    found = []
    for run in runs.values():
        if run.base.upper() != worse or not run.swapped:
            continue
        gain = run.expected_accept_len - low.expected_accept_len
        if gain > _noise(leads[run.name], leads[low.name]):
            found.append((len(run.swapped), -gain, run))
    if not found:
        return Conclusion(f"no input swap moves acceptance by more than the noise ({figures}): the "
                          "difference is not in the draft's inputs", None)
    _, _, best = min(found, key=lambda f: (f[0], f[1]))
    what = _groups(best.swapped)
    verb = "costs" if len(best.swapped) == 1 else "cost"
    text = (f"{worse}'s {what} {verb} {abs(cost):.2f} accepted tokens per verify "
            f"({high.expected_accept_len:.2f} -> {low.expected_accept_len:.2f}); with {better}'s {what} "
            f"{worse} recovers {best.expected_accept_len:.2f}")
    left = high.expected_accept_len - best.expected_accept_len
    if left > _noise(leads[best.name], leads[high.name]):
        text += f" ({left:.2f} still unexplained)"
    others = [g for g in differing if g not in best.swapped]
    if others:
        text += f"; the sides' {_groups(others)} {'differs' if len(others) == 1 else 'differ'} too"
    if "draft" not in differing:
        text += ("; the draft computation is the same on both sides (one checkpoint, one reading of its "
                 "config)")
    return Conclusion(text, best.name)


def _recorded_agreement(trace: Trace, pairs: list[PairedRows], side: Side, d2t: torch.Tensor,
                        drafted: list[np.ndarray]) -> float | None:
    """The share of the side's recorded depth-0 drafts (over the shared rows) that the draft
    replayed on the side's own inputs gave (``drafted``: the side's base run, per pair): the draft
    id (``draft.token``) and, where recorded, the target id it maps to (``draft.token_target``, under
    the side's vocab map). 1.0 when the recording is what the checkpoint computes; None when the
    trace records neither."""
    names = [n for n in ("draft.token", "draft.token_target") if n in trace.names()]
    if not names:
        return None
    recorded = {n: trace.rows(n, depth=0) for n in names}
    same = seen = 0
    for pair, ids in zip(pairs, drafted):
        request = pair.request_a if side == "a" else pair.request_b
        at = {}
        for n, r in recorded.items():
            mine = r.request == request
            at[n] = {int(p): int(v) for p, v in zip(r.position[mine], r.numpy()[mine])}
        inputs = getattr(pair, side)
        rows = [p for p in range(len(inputs.ids)) if any(p in values for values in at.values())]
        if not rows:
            continue
        replayed = {"draft.token": ids, "draft.token_target": (torch.from_numpy(ids) + d2t[ids]).numpy()}
        same += sum(all(int(replayed[n][p]) == values[p] for n, values in at.items() if p in values)
                    for p in rows)
        seen += len(rows)
    return same / seen if seen else None
