"""Token mismatch: the sides' token sequences differ at some position (another chat template, a
different prompt). Rows past that position are not aligned; a draft row just before it embeds the
differing token, so when the first divergence is that row, the differing token is the cause.

Where both sides recorded one text that differs by an edit (``Comparison.text_edit``), the edit is
the finding itself (an error): the sides were fed other text."""

from __future__ import annotations

from dataclasses import replace

from tracediff.diff.align import first_token_difference
from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.findings import Diagnosis, TokenMismatchEvidence


def token_mismatch(ctx: Context) -> list[Diagnosis]:
    comparison = ctx.comparison
    m = comparison.token_mismatch
    if m is None:
        return []
    labels = ctx.labels
    edit = comparison.text_edit
    if edit is not None:  # the same text on both sides but for an edit: the verdict's own cause
        evidence = TokenMismatchEvidence(edit.request_a, edit.request_b, edit.position, edit.token_a,
                                         edit.token_b, requests_differing=edit.requests,
                                         linked_to_first_divergence=True)
        said = edit.line((labels.a, labels.b))
        return [Diagnosis("token_mismatch", f"the sides were fed other text: {said}", evidence,
                          severity="error")]
    first = comparison.first_divergence
    name = first.name if first is not None else ""
    row = first.first_bad if first is not None and name.startswith("draft.") else None  # a draft row
    if row is not None:
        # the draft row at p embeds token p + 1: did its request's tokens differ there?
        own = first_token_difference(comparison.plan.prefixes, request_b=row.request_b)
        m = m if own is None else replace(own, requests_differing=m.requests_differing)
    linked = row is not None and row.request_b == m.request_b and row.position + 1 + row.depth >= m.position
    message = (f"token sequences differ: request {m.request_b} ({labels.b}) holds {m.token_b} at position "
               f"{m.position} where {m.request_a} ({labels.a}) holds {m.token_a}"
               + (f" ({m.requests_differing} requests differ)" if m.requests_differing > 1 else ""))
    if row is not None and linked:
        message += f"; {name} at position {row.position} consumed that token"
    else:
        message += "; rows past it are not aligned"
    evidence = TokenMismatchEvidence(**vars(m), linked_to_first_divergence=linked)
    return [Diagnosis("token_mismatch", message, evidence, severity="error" if linked else "warning")]
