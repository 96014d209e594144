"""Draft depths one side never drafted: training unrolled more depths than serving drafts (a
``--speculative-num-steps`` that silently clamps ``--speculative-num-draft-tokens``, a TTT length
longer than the served chain), or the other way round. Those depths are never compared: say so, and
say what the contracts state about it. Runs whether or not anything diverged."""

from __future__ import annotations

from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.findings import Diagnosis, DraftDepthsEvidence
from tracediff.diff.pair import Pair
from tracediff.diff.verdict import depth_span


def draft_depths(ctx: Context) -> list[Diagnosis]:
    comparison, traces = ctx.comparison, ctx.traces
    recorded = Pair(*(sorted({int(d) for keys in side.values() for d in set(keys.depth.tolist())})
                      for side in (comparison.plan.keys.a, comparison.plan.keys.b)))
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
    if shallow.speculative_args is not None:  # a server: its chains are what it drafts per verify
        args = [f"{k} {v}" for k, v in (("num_steps", evidence.num_steps), ("topk", evidence.topk),
                                         ("num_draft_tokens", evidence.num_draft_tokens)) if v is not None]
        text = (f"{getattr(labels, shallower)} drafts {n_shallow} token{'s' if n_shallow != 1 else ''} "
                f"per verify ({', '.join(args)})")
    else:
        text = f"{getattr(labels, shallower)} recorded draft {depth_span(list(range(n_shallow)))}"
    requested, resolved = evidence.num_draft_tokens_requested, evidence.num_draft_tokens
    if requested is not None and resolved is not None and requested != resolved:
        text += f"; {requested} draft tokens were asked for and the server resolved {resolved}"
    text += f"; {getattr(labels, deeper)} "
    trained = _int(deep_says.get("ttt_length"))
    text += (f"trained {n_deep} depths (ttt_length {trained})" if trained
             else f"recorded draft {depth_span(list(range(n_deep)))}")
    gap = [d for d in only if d in getattr(recorded, deeper)]
    text += f": {depth_span(gap) if gap else 'depths ' + str(only)} never served, so never compared"
    return [Diagnosis("draft_depths", text, evidence, severity="warning")]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
