"""The run contracts of two traces: which stated conventions differ, and whether the traces can be
compared at all (different target models, tokenizers or vocabularies make every row meaningless)."""

from __future__ import annotations

import numpy as np

from tracediff.diff.align import Prefixes
from tracediff.diff.pair import Pair
from tracediff.diff.results import ContractDiff, ContractEntry
from tracediff.trace.reader import Trace

# Contract keys that, when both sides state them and they differ, make the traces incomparable.
IDENTITY = {"target_model": "target models", "tokenizer_sha256": "tokenizers", "vocab_size": "vocab sizes",
            "target_vocab_size": "target vocab sizes"}


def contract(trace: Trace) -> dict:
    """The contract as the run opened it, updated by what it learned before closing (per file)."""
    opened = trace.meta.get("contract")
    merged = dict(opened) if isinstance(opened, dict) else {}
    for final in trace.finals:
        learned = final.get("contract") if isinstance(final, dict) else None
        merged.update(learned if isinstance(learned, dict) else {})
    return merged


def contract_diff(traces: Pair[Trace]) -> ContractDiff:
    """Keys whose values differ, apart from keys only one side states."""
    a, b = traces.map(contract).a, traces.map(contract).b
    return ContractDiff(
        differing=[ContractEntry(k, a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k] != b[k]],
        only_a={k: a[k] for k in sorted(a.keys() - b.keys())},
        only_b={k: b[k] for k in sorted(b.keys() - a.keys())},
    )


def incomparable(diff: ContractDiff, prefixes: Pair[Prefixes]) -> list[str]:
    """Why no row of one trace can stand for a row of the other, one line each (empty when they can)."""
    reasons = [f"the contracts name different {IDENTITY[e.key]}: a {e.a!r}, b {e.b!r}"
               for e in diff.differing if e.key in IDENTITY]
    if not shares_tokens(prefixes):
        reasons.append("the traces share no token prefix: their requests' tokens differ from the start")
    return reasons


def shares_tokens(prefixes: Pair[Prefixes]) -> bool:
    """Whether some request of one side starts like a request of the other (even by one token: a
    shared BOS token gives a few comparable rows, and a coverage that says how few). True when a
    side knows no tokens."""
    if not len(prefixes.a.ids) or not len(prefixes.b.ids):
        return True
    return bool(np.isin(prefixes.a.ids, prefixes.b.ids).any())
