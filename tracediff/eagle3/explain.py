"""Explain: which of the draft's inputs costs how many accepted tokens, proven by replaying it.
The draft runs teacher-forced on A's inputs, on B's, and on each side with an input group (or two)
taken from the other; the run whose swap restores acceptance names the input that costs it.

Two traces of the same texts (training and serving, two servers) are paired request by request on
the rows whose text agrees from position 0 (the rows both sides hold). The input groups are the
fc input (``draft.fc_in``), the ids fed to the draft (``draft.input_ids``), the RoPE positions
(``draft.positions``), the vocab map (each side's recorded ``draft.d2t``, else the checkpoint's)
and the draft computation (the checkpoint, and the engine's reading of its config:
tracediff/eagle3/readings.py). Every run is scored as replay scores a trace: the server's chains
where one side is a serving trace (both servers' where both are: the same figures in either
order), else every row, a chain only where every depth of it has a recorded target token (the
others are counted, unscored); accept length and accuracy per depth, with the chains each rests
on. A difference counts when it exceeds twice the standard error of the per-chain differences
between the two runs (the noise of a figure over few chains).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tracediff.eagle3.chains import drafted_from, leading_hits, tree_shape
from tracediff.eagle3.draft import Eagle3Draft
from tracediff.eagle3.explanation import GROUP_NAMES, GROUPS, Explanation, Run, Side
from tracediff.eagle3.names import DRAFT_D2T, DRAFT_LOGITS, DRAFT_TOKEN, DRAFT_TOKEN_TARGET
from tracediff.eagle3.replay import (
    FcRows,
    RequestRows,
    bounded,
    by_position,
    chain_depths,
    config_mismatch,
    contiguous_rows,
    draft_depth_bound,
    request_rows,
    teacher_forced,
    trace_depth_bound,
)
from tracediff.errors import InputError
from tracediff.trace.dtypes import decode
from tracediff.trace.reader import Trace

VOCAB_BUFFERS = ("d2t", "t2d")  # the vocab map is its own group, not the draft computation's
MIN_CHAINS = 5  # fewer chains tell no difference from noise
NOISE_SE = 2.0  # a difference counts beyond this many standard errors of the per-chain differences
FC_RTOL, FC_ATOL = 1e-5, 1e-6  # fc inputs this close are the same input (float round-off)


class SideRows(NamedTuple):
    """One side's draft inputs over the rows a request pair shares (n rows, position order); the fc
    input stays in the trace until the pair is replayed (``FcRows.read``)."""

    fc: FcRows  # [n, K*H] float32 once read
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


class Inputs(NamedTuple):
    """Everything a run draws from one side."""

    draft: Eagle3Draft
    d2t: torch.Tensor  # offsets, [draft vocab]


def explain_traces(a: Trace, b: Trace, drafts: dict[str, Eagle3Draft], depths: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> Explanation:
    """Replay ``drafts['a']`` on A's inputs, ``drafts['b']`` on B's, and the swaps (see the module
    docstring). ``InputError`` when the traces share no scorable row."""
    served = {"a": drafted_from(a), "b": drafted_from(b)}  # each server's chains, read once
    pairing = paired_rows(a, b, served)
    pairs = pairing.pairs
    if not pairs:
        lacking = sum(pairing.unpaired[side]["no_context"] for side in "ab")
        why = f"; {lacking} of the requests lack their first rows (prefix-cache hits on rows no recorded " \
              "request holds)" if lacking else ""
        raise InputError(b.paths[0], f"shares no request text with {a.paths[0]} (no request of one agrees "
                                     f"with one of the other from position 0{why}): nothing to replay on "
                                     "both")
    servers = [t for t, side in ((a, "a"), (b, "b")) if served[side]]
    # the longer chain of two servers' (either order alike); a training side's depths where none serves
    bounds = [*map(trace_depth_bound, (a, b)), *(draft_depth_bound(d.config) for d in drafts.values())]
    choice = bounded(max((chain_depths(t, depths) for t in servers or [b]), key=lambda c: c.depths), bounds)
    sides = {"a": Inputs(drafts["a"], _d2t(a, drafts["a"])), "b": Inputs(drafts["b"], _d2t(b, drafts["b"]))}
    differing = [g for g in GROUPS if _differs(g, pairs, sides)]
    plan = _runnable(run_plan(differing), pairs, sides)
    scores = score_runs(plan, pairs, sides, choice.depths, progress)
    common = np.logical_and.reduce([sc.leads >= 0 for sc in scores.values()])  # chains every run scores
    runs = {name: sc.over(common) for name, sc in scores.items()}
    leads = {name: np.where(common, sc.leads, -1) for name, sc in scores.items()}
    base_a, base_b = runs["A's inputs"], runs["B's inputs"]
    if base_a.chains == 0:
        anchors = sum(int(p.chains.sum()) for p in pairs)
        raise InputError(b.paths[0], f"explain has no chain to score: the {sum(len(p.a.ids) for p in pairs)} "
                                     f"rows the {len(pairs)} request pairs share hold {anchors} of the "
                                     "server's chains, none with the target's tokens after it recorded"
                                     + (" (the pairs share prompt rows only)" if not anchors else ""))
    noise = _noise(leads["A's inputs"], leads["B's inputs"])
    cost = base_a.expected_accept_len - base_b.expected_accept_len
    agreement = {"a": _recorded_agreement(a, pairs, "a", sides["a"].d2t, scores["A's inputs"].drafted),
                 "b": _recorded_agreement(b, pairs, "b", sides["b"].d2t, scores["B's inputs"].drafted)}
    logits = {"a": recorded_logits_diff(a, pairs, "a", drafts["a"]),
              "b": recorded_logits_diff(b, pairs, "b", drafts["b"])}
    mismatch = {"a": config_mismatch(drafts["a"], a), "b": config_mismatch(drafts["b"], b)}
    verdict = conclude(runs, differing, cost, noise, leads, caveats(agreement, mismatch), pairing.unpaired)
    tree = next((shape for t in servers if (shape := tree_shape(t)) is not None), None)
    return Explanation(
        a=a.name, b=b.name, conclusion=verdict.text, restored_by=verdict.restored_by,
        depths=choice.depths, depths_from=choice.reason,
        scored_on=("both servers' chains" if len(servers) == 2 else "the server's chains") if servers and
        tree is None else
        "every row" if tree is None else f"every row, not the server's figure: {tree}",
        requests=len(pairs), rows=sum(len(p.a.ids) for p in pairs), differing=differing, cost=cost,
        noise=noise, chains_unscored=int((~common).sum()),
        runs=list(runs.values()), recorded_agreement=agreement, recorded_logits_max_diff=logits,
        unpaired=pairing.unpaired, rows_left=pairing.rows_left)


UNPAIRED = {  # why a request of one side has no partner on the other -> how the conclusion says it
    "no_shared_text": "share no text with the other side",
    "partner_taken": "share text only with requests paired on more of theirs",
    "no_context": "lack their first rows (a prefix-cache hit on rows no recorded request holds)",
}


class Pairing(NamedTuple):
    """The request pairs; per side, the requests left unpaired by reason (``UNPAIRED``) and the
    rows never replayed (those of unpaired requests, and a pair's rows past what both share)."""

    pairs: list[PairedRows]
    unpaired: dict[str, dict[str, int]]
    rows_left: dict[str, int]


def paired_rows(a: Trace, b: Trace, served: dict[str, dict[str, set[int]]]) -> Pairing:
    """Requests of A and B paired one to one, longest agreement first: a row is shared when both
    sides hold it with the same text through the token after it (x[0..t+1]), so two conversations
    that part after a common system prompt share only the rows before they part. ``served``: each
    side's chains (``drafted_from``)."""
    rows_a, rows_b = list(request_rows(a, None)), list(request_rows(b, None))
    chains_a, chains_b = served["a"], served["b"]
    pairs, texts_a, texts_b = [], [_text(r) for r in rows_a], [_text(r) for r in rows_b]
    found = longest_agreements(texts_a, texts_b)
    for i, j, shared in found:
        ra, rb = rows_a[i], rows_b[j]
        # the rows either server drafted from (both servers' alike: either order gives one set)
        anchors = set(chains_a.get(ra.request, ())) | set(chains_b.get(rb.request, ()))
        positions = np.arange(shared)
        chains = np.ones(shared, bool) if not (chains_a or chains_b) else np.isin(positions, sorted(anchors))
        # the target's tokens: the chains' side's (B's unless only A is a server's), and the other's
        # where the texts agree (a label at p is x[p+1]): the same figures whichever trace comes first
        own, other = (ra, rb) if chains_a and not chains_b else (rb, ra)
        labels = {**{p: v for p, v in other.target_at.items() if p + 1 < shared}, **own.target_at}
        pairs.append(PairedRows(ra.request, rb.request, _side(ra, shared), _side(rb, shared), labels, chains))
    unpaired = {"a": _unpaired(texts_a, {i for i, _, _ in found}, texts_b),
                "b": _unpaired(texts_b, {j for _, j, _ in found}, texts_a)}
    shared_rows = sum(n for _, _, n in found)
    rows_left = {side: sum(len(r.positions) for r in rows) - shared_rows for side, rows in (("a", rows_a),
                                                                                         ("b", rows_b))}
    return Pairing(sorted(pairs, key=lambda p: p.request_b), unpaired, rows_left)


def _unpaired(texts: list[tuple[int, ...]], paired: set[int],
              others: list[tuple[int, ...]]) -> dict[str, int]:
    """How many of one side's requests went unpaired, by reason (``UNPAIRED``)."""
    firsts = {t[0] for t in others if t}
    out = dict.fromkeys(UNPAIRED, 0)
    for i, text in enumerate(texts):
        if i not in paired:
            out["no_context" if not text else "partner_taken" if text[0] in firsts else "no_shared_text"] += 1
    return out


class _Node:
    """A node of the trie of texts, at ``depth`` rows: the requests of each side below it not yet paired."""

    def __init__(self, depth: int) -> None:
        self.depth, self.a, self.b = depth, [], []  # type: ignore[var-annotated]

    def absorb(self, child: _Node) -> None:
        self.a += child.a
        self.b += child.b


def longest_agreements(texts_a: list[tuple[int, ...]], texts_b: list[tuple[int, ...]]
                       ) -> list[tuple[int, int, int]]:
    """(i, j, rows) pairing ``texts_a[i]`` with ``texts_b[j]`` one to one, the longest common prefix
    first (ties: lowest i, then lowest j), pairs that agree on no row left out. The greedy of every
    pair sorted by agreement, found without comparing every pair: the texts sorted, the common
    prefix of neighbours builds their trie, and each node, deepest first, pairs what its children
    left unpaired (any two of them agree there and no deeper)."""
    items = sorted([(t, 0, i) for i, t in enumerate(texts_a)] + [(t, 1, j) for j, t in enumerate(texts_b)])
    out: list[tuple[int, int, int]] = []

    def settle(node: _Node) -> None:
        node.a.sort()
        node.b.sort()
        k = min(len(node.a), len(node.b))
        if node.depth > 0:
            out.extend((i, j, node.depth) for i, j in zip(node.a[:k], node.b[:k]))
            node.a, node.b = node.a[k:], node.b[k:]

    stack = [_Node(0)]
    previous: tuple[int, ...] = ()
    for text, side, index in items:
        common = _common_prefix(previous, text)
        while stack[-1].depth > common:
            node = stack.pop()
            settle(node)
            if stack[-1].depth < common:
                stack.append(_Node(common))
            stack[-1].absorb(node)
        if stack[-1].depth != len(text):
            stack.append(_Node(len(text)))
        (stack[-1].a if side == 0 else stack[-1].b).append(index)
        previous = text
    while len(stack) > 1:
        node = stack.pop()
        settle(node)
        stack[-1].absorb(node)
    return sorted(out, key=lambda p: (-p[2], p[0], p[1]))


def _common_prefix(x: tuple[int, ...], y: tuple[int, ...]) -> int:
    n = min(len(x), len(y))
    if n == 0:
        return 0
    same = np.asarray(x[:n]) == np.asarray(y[:n])
    return n if same.all() else int(np.argmin(same))


def _text(rows: RequestRows) -> tuple[int, ...]:
    """A request's rows from position 0 as one token sequence, a row its token and the next one
    (x[t], x[t+1]) packed in one int: two requests share the rows of their common prefix. Empty
    when the rows do not start at position 0 (nothing to pair)."""
    n = contiguous_rows(rows.positions)
    if n == 0 or rows.positions[0] != 0:
        return ()
    both = _through_next(rows, n).astype(np.int64) + 1  # -1 (unknown) -> 0
    return tuple((both[:, 0] << 32 | both[:, 1]).tolist())


def _through_next(rows: RequestRows, n: int) -> np.ndarray:
    """[n, 2]: each row's token and the text's next token (the last row's: what it was fed)."""
    nxt = np.append(rows.tokens[1:n], rows.next_tokens[n - 1])
    return np.stack([rows.tokens[:n], nxt], axis=1)


def _side(rows: RequestRows, n: int) -> SideRows:
    return SideRows(rows.fc.head(n), rows.next_tokens[:n], rows.rope_positions[:n])


def _d2t(trace: Trace, draft: Eagle3Draft) -> torch.Tensor:
    """The vocab map the side ran: its recorded ``draft.d2t``; none at all where its server applied
    none (``vocab_map_applied`` false: draft ids are target ids); else the checkpoint's."""
    recorded = trace.last_static(DRAFT_D2T)
    if recorded is not None and recorded.data.shape == tuple(draft.d2t.shape):
        return torch.from_numpy(np.array(recorded.data, dtype=np.int64))  # a copy: Arrow's is read-only
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
    for pair in pairs:  # one pair's fc inputs in memory at a time; the first difference ends the pass
        if group == "fc_in":
            if pair.a.fc.width != pair.b.fc.width:
                return True
            if not np.allclose(pair.a.fc.read(), pair.b.fc.read(), rtol=FC_RTOL, atol=FC_ATOL):
                return True
        elif not np.array_equal(*(getattr(side, "ids" if group == "input_ids" else group)
                                  for side in (pair.a, pair.b))):
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


class RunSpec(NamedTuple):
    """One planned replay: its name, its base side, the groups it takes from the other side, and so
    the side each group comes from (``pick``)."""

    name: str
    base: Side
    swapped: tuple[str, ...]
    pick: dict[str, Side]


def run_plan(differing: Sequence[str]) -> tuple[RunSpec, ...]:
    """A's inputs, B's, each differing group swapped into either side, and each pair of them into
    B (effects may not add up): 2 + 2g + g(g-1)/2 runs."""
    def spec(base: Side, swapped: tuple[str, ...]) -> RunSpec:
        other: Side = "b" if base == "a" else "a"
        name = f"{base.upper()}'s inputs" if not swapped else \
            f"{base.upper()} with {other.upper()}'s {' and '.join(GROUP_NAMES[g] for g in swapped)}"
        return RunSpec(name, base, swapped, {g: (other if g in swapped else base) for g in GROUPS})

    singles = [spec(base, (group,)) for group in differing for base in ("b", "a")]
    pairs = [spec("b", both) for both in itertools.combinations(differing, 2)]
    return (spec("a", ()), spec("b", ()), *singles, *pairs)


def _runnable(plan: Sequence[RunSpec], pairs: list[PairedRows],
              sides: dict[str, Inputs]) -> tuple[RunSpec, ...]:
    """The runs whose draft takes the fc input they feed it: a side's own draft on its own fc input
    must (InputError otherwise, as replay says it); a swap of fc inputs of other widths (two
    checkpoints with other aux slot counts) cannot run, and is left out."""
    width = {side: getattr(pairs[0], side).fc.width for side in "ab"}
    for side in ("a", "b"):
        takes = sides[side].draft.fc.in_features
        if width[side] != takes:
            hidden = sides[side].draft.config.target_hidden
            option = "--draft" if side == "a" else "--draft-b (or --draft)"
            raise InputError(option, f"{side.upper()}'s fc input (draft.fc_in) is {width[side]} wide "
                                     f"({width[side] / hidden:g} slots of {hidden}); the draft's fc takes "
                                     f"{takes} ({takes // hidden} slots): not the checkpoint that trace was "
                                     "drafted with")
    return tuple(spec for spec in plan
                 if width[spec.pick["fc_in"]] == sides[spec.pick["draft"]].draft.fc.in_features)


def score_runs(plan: Sequence[RunSpec], pairs: list[PairedRows], sides: dict[str, Inputs], depths: int,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Scores]:
    """Every planned run over every pair, pair by pair: a pair's fc inputs are read once and are the
    only tensor rows in memory (bounded, whatever the traces' size). ``progress(done, total)``
    hears rows replayed, over every run."""
    correct = {spec.name: np.zeros(depths, int) for spec in plan}
    total = {spec.name: np.zeros(depths, int) for spec in plan}
    lead: dict[str, list[np.ndarray]] = {spec.name: [] for spec in plan}
    drafted: dict[str, list[np.ndarray]] = {spec.name: [] for spec in plan}
    planned, done = sum(len(p.a.ids) for p in pairs) * len(plan), 0
    for pair in pairs:
        fc_in = {"a": pair.a.fc.read(), "b": pair.b.fc.read()}
        for spec in plan:
            draft, d2t = sides[spec.pick["draft"]].draft, sides[spec.pick["d2t"]].d2t
            fed = getattr(pair, spec.pick["input_ids"]).ids
            rotated = getattr(pair, spec.pick["positions"]).positions
            scored = teacher_forced(draft, fc_in[spec.pick["fc_in"]], fed, rotated, depths, pair.labels,
                                    lambda ids, d2t=d2t: ids + d2t[ids])
            correct[spec.name] += scored.hits.sum(axis=0)
            total[spec.name] += scored.valid.sum(axis=0)
            lead[spec.name].append(leading_hits(scored.hits, scored.valid)[pair.chains])
            drafted[spec.name].append(scored.results[0].logits[0].argmax(-1).numpy())
            done += len(pair.a.ids)
            if progress is not None:
                progress(done, planned)
    return {spec.name: Scores(spec.name, spec.base, list(spec.swapped),
                              np.concatenate(lead[spec.name]) if lead[spec.name] else np.zeros(0, int),
                              correct[spec.name], total[spec.name], drafted[spec.name]) for spec in plan}


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
             unpaired: dict[str, dict[str, int]] | None = None) -> Conclusion:
    """The one line the evidence supports, after what limits it (``warnings``: ``caveats``), and
    what it never saw (``unpaired`` requests of a side, by reason: ``UNPAIRED``)."""
    verdict = _verdict(runs, differing, cost, noise, leads)
    text = verdict.text
    if warnings:
        text = f"{'; '.join(warnings)}; with the checkpoints given: {text}"
    unseen = [f"{n} of {side.upper()}'s requests {UNPAIRED[why]}"
              for side, reasons in (unpaired or {}).items() for why, n in reasons.items() if n]
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
    names = [n for n in (DRAFT_TOKEN, DRAFT_TOKEN_TARGET) if n in trace.names()]
    if not names:
        return None
    recorded = {n: trace.rows(n, depth=0) for n in names}
    where = {n: by_position(r) for n, r in recorded.items()}
    values = {n: r.numpy() for n, r in recorded.items()}
    same = seen = 0
    for pair, ids in zip(pairs, drafted):
        request = pair.request_a if side == "a" else pair.request_b
        at = {n: {p: int(values[n][i]) for p, i in where[n].get(request, {}).items()} for n in names}
        inputs = getattr(pair, side)
        rows = [p for p in range(len(inputs.ids)) if any(p in values for values in at.values())]
        if not rows:
            continue
        replayed = {DRAFT_TOKEN: ids, DRAFT_TOKEN_TARGET: (torch.from_numpy(ids) + d2t[ids]).numpy()}
        same += sum(all(int(replayed[n][p]) == values[p] for n, values in at.items() if p in values)
                    for p in rows)
        seen += len(rows)
    return same / seen if seen else None


def recorded_logits_diff(trace: Trace, pairs: list[PairedRows], side: Side,
                         draft: Eagle3Draft) -> float | None:
    """The largest |replayed - recorded| of the side's depth-0 ``draft.logits`` over the shared rows
    where it recorded them, the draft replayed on the side's own inputs: about float round-off when
    the recording is what the checkpoint computes. A pair's rows are read and replayed at a time
    (one depth). None when the trace records no draft logits of the draft's vocabulary."""
    if DRAFT_LOGITS not in trace.names():
        return None
    keys = trace.keys(DRAFT_LOGITS, depth=0)
    if keys.row_shape != (draft.lm_head.out_features,):
        return None
    where = by_position(keys)
    worst: float | None = None
    for pair in pairs:
        inputs = getattr(pair, side)
        at = where.get(pair.request_a if side == "a" else pair.request_b, {})
        rows = [p for p in range(len(inputs.ids)) if p in at]
        if not rows:
            continue
        recorded = decode(trace.gather(keys, np.array([at[p] for p in rows], dtype=np.int64)), keys.dtype)
        with torch.no_grad():
            fc_in = torch.from_numpy(inputs.fc.read()[None])
            result = draft.unroll(fc_in, torch.from_numpy(inputs.ids[None]), 1,
                                  positions=torch.from_numpy(inputs.positions[None]))[0]
        replayed = result.logits[0, rows].float().numpy()
        diff = float(np.abs(replayed - recorded.astype(np.float32)).max())
        worst = diff if worst is None or not diff <= worst else worst
    return worst
