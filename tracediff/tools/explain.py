"""``tracediff.explain``: everything the ``explain`` command does, as one library call returning the typed
``Explanation`` (eagle3/explain.py computes it from open traces and loaded drafts; this is what a user asks
for, from paths).

    >>> import tracediff as td                                                        # doctest: +SKIP
    >>> ex = td.explain("train.h5", "serve.h5", "draft_dir", target="target_dir")     # doctest: +SKIP
    >>> ex.differing                                                                  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch: loaded by the call, not by ``tracediff --help``
    from tracediff.eagle3.explanation import Explanation


def explain(a: str | Path, b: str | Path, draft: str | Path, *, draft_b: str | Path | None = None,
            target: str | Path | None = None, depths: int | None = None,
            progress: Callable[[int, int], None] | None = None, verify: bool = True) -> Explanation:
    """``tracediff explain A B --draft D``: the checkpoint(s) loaded as the engine that recorded
    each trace reads them (``draft_b`` for B when it differs; the target's embedding, and lm_head
    where the engine takes it, from ``target``), then ``explain_traces``. ``progress(done, total)``
    hears rows replayed. ``InputError`` (one line) for unreadable inputs."""
    from tracediff.eagle3.checkpoint import load_draft, target_embedding, target_tensor
    from tracediff.eagle3.explain import explain_traces
    from tracediff.eagle3.readings import engine_choice
    from tracediff.trace.reader import open_trace

    embed = target_embedding(target) if target else None
    head = target_tensor(target, "lm_head") if target else None
    with open_trace(a, verify=verify) as ta, open_trace(b, verify=verify) as tb:
        readings = {side: engine_choice(t.engine).reading for side, t in (("a", ta), ("b", tb))}
        drafts = {"a": load_draft(draft, embed, reading=readings["a"], target_head=head)}
        same = draft_b is None and readings["a"] == readings["b"]
        drafts["b"] = drafts["a"] if same else load_draft(draft_b or draft, embed, reading=readings["b"],
                                                          target_head=head)
        return explain_traces(ta, tb, drafts, depths, progress)
