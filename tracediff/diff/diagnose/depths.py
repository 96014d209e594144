"""Draft depths one side never drafted: training unrolled more depths than serving drafts (a
``--speculative-num-steps`` that silently clamps ``--speculative-num-draft-tokens``, a TTT length
longer than the served chain), or the other way round. Those depths are never compared: say so, and
say what the contracts state about it. Runs whether or not anything diverged.

A side's depths are those its draft rows hold: a side that recorded no draft row (its recording
stopped first) says nothing here, and a side that recorded fewer depths than its contract states
is said to have recorded them, never to draft or train only those."""

from __future__ import annotations

from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.findings import Diagnosis, DraftDepthsEvidence
from tracediff.diff.verdict import depth_span
from tracediff.trace.reader import RowKeys, Trace

DRAFT = "draft."  # the names whose rows are draft rows (target rows are all depth 0)


def draft_depths(ctx: Context) -> list[Diagnosis]:
    comparison, traces = ctx.comparison, ctx.traces
    recorded = comparison.plan.keys.map(drafted)
    if not recorded.a or not recorded.b or set(recorded.a) == set(recorded.b):
        return []
    only = sorted(set(recorded.a) ^ set(recorded.b))
    deeper, shallower = ("a", "b") if max(recorded.a) > max(recorded.b) else ("b", "a")
    deep, shallow = getattr(traces, deeper), getattr(traces, shallower)
    deep_says, shallow_says = deep.contract, shallow.contract
    ttt = _int(deep_says.get("ttt_length")) or _int(shallow_says.get("ttt_length"))
    spec = shallow.speculative_args or deep.speculative_args or {}
    asked = shallow.speculative_args_requested or deep.speculative_args_requested or {}
    evidence = DraftDepthsEvidence(depths_a=max(recorded.a) + 1, depths_b=max(recorded.b) + 1,
                                   never_compared=only, ttt_length=ttt, num_steps=_int(spec.get("num_steps")),
                                   topk=_int(spec.get("topk")),
                                   num_draft_tokens=_int(spec.get("num_draft_tokens")),
                                   num_draft_tokens_requested=_int(asked.get("num_draft_tokens")))
    labels = ctx.labels
    n_deep, n_shallow = getattr(evidence, f"depths_{deeper}"), getattr(evidence, f"depths_{shallower}")
    text = f"{getattr(labels, shallower)} {said(shallow, n_shallow)}"
    requested, resolved = evidence.num_draft_tokens_requested, evidence.num_draft_tokens
    if requested is not None and resolved is not None and requested != resolved:
        text += f"; {requested} draft tokens were asked for and the server resolved {resolved}"
    text += f"; {getattr(labels, deeper)} {said(deep, n_deep)}"
    gap = [d for d in only if d in getattr(recorded, deeper)]
    text += f": {_gap(gap, shallow, getattr(labels, shallower)) if gap else 'depths ' + str(only)}, " \
            "so never compared"
    return [Diagnosis("draft_depths", text, evidence, severity="warning")]


def drafted(keys: dict[str, RowKeys]) -> list[int]:
    """The depths a side's draft rows hold, ascending."""
    return sorted({int(d) for name, side in keys.items() if name.startswith(DRAFT)
                   for d in set(side.depth.tolist())})


def said(trace: Trace, n: int) -> str:
    """What a side did with its ``n`` recorded depths: a server drafts them per verify and a trainer
    trains them where its contract states that many (``num_steps``, ``ttt_length``); else they are
    what it recorded, next to what its contract states."""
    steps, ttt = _depths_stated(trace)
    recorded = f"recorded draft {depth_span(list(range(n)))}"
    if trace.speculative_args is not None:
        spec = trace.speculative_args
        args = ", ".join(f"{k} {spec[k]}" for k in ("num_steps", "topk", "num_draft_tokens")
                         if _int(spec.get(k)) is not None)
        if steps == n:
            return f"drafts {n} token{'s' if n != 1 else ''} per verify ({args})"
        return f"{recorded} (its contract states {args})" if args else recorded
    if ttt is not None:
        return f"trained {n} depths (ttt_length {ttt})" if ttt == n else \
            f"{recorded} (its contract states ttt_length {ttt})"
    return recorded


def _gap(gap: list[int], shallow: Trace, label: str) -> str:
    """``depths 2-3 never served``: the depths only the deeper side holds, by why the shallower lacks
    them: within what it drafts or trains (its contract's ``num_steps`` / ``ttt_length``) and not
    recorded, or beyond it."""
    steps, ttt = _depths_stated(shallow)
    stated = steps if shallow.speculative_args is not None else ttt
    beyond = [d for d in gap if stated is not None and d >= stated]
    within = [d for d in gap if d not in beyond]
    verb = "served" if shallow.speculative_args is not None else "trained"
    parts = ([f"{depth_span(within)} not recorded by {label}"] if within else []) + \
        ([f"{depth_span(beyond)} never {verb}"] if beyond else [])
    return ", ".join(parts)


def _depths_stated(trace: Trace) -> tuple[int | None, int | None]:
    """(``num_steps`` of the speculative arguments, ``ttt_length``) as the contract states them."""
    return _int((trace.speculative_args or {}).get("num_steps")), _int(trace.contract.get("ttt_length"))


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
