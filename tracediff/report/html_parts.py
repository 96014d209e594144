"""HTML pieces of the report that are tables rather than pictures: the slot-matching matrix of a
concatenated input, both sides' tokens, the tensor table and the contract differences."""

from __future__ import annotations

import json
from typing import Any

from tracediff.diff.findings import Diagnosis, SlotNormEvidence, SlotsEvidence
from tracediff.diff.results import Report, TensorResult, TokenView
from tracediff.report.compare import SHOWN, contract_differences
from tracediff.report.svg import divergence, esc, num

TOKENS_PER_LINE = 24
CONTRACT_CHARS = 400  # characters of a contract value shown


def _bare(state: str | None) -> str | None:
    """``norm(target.layer.3)`` -> ``target.layer.3``: the state a normed slot holds."""
    if state is not None and state.startswith("norm(") and state.endswith(")"):
        return state[5:-1]
    return state


def slot_evidence(diagnoses: list[Diagnosis]) -> list[SlotsEvidence | SlotNormEvidence]:
    """One evidence per distinct (tensor, slots a, slots b): several norm findings share their slots."""
    seen, out = set(), []
    for d in diagnoses:
        ev = d.evidence
        if isinstance(ev, (SlotsEvidence, SlotNormEvidence)):
            key = (ev.tensor, tuple(ev.slots_a), tuple(ev.slots_b))
            if key not in seen:
                seen.add(key)
                out.append(ev)
    return out


def slot_matrix(ev: SlotsEvidence | SlotNormEvidence) -> str:
    """Rows: a's slots, columns: b's slots; a mark where both hold the same target state. Wired alike,
    the marks lie on the diagonal."""
    def name(state: str | None) -> str:
        return esc(state) if state is not None else '<span class="muted">unknown</span>'

    head = "".join(f'<th class="sm-col">b slot {j}<br><code>{name(s)}</code></th>'
                   for j, s in enumerate(ev.slots_b))
    body = []
    for i, sa in enumerate(ev.slots_a):
        cells = []
        for j, sb in enumerate(ev.slots_b):
            same = sa is not None and sa == sb
            normed = not same and sa is not None and _bare(sa) == _bare(sb)
            diagonal = i == j
            if same:
                cls, mark = ("sm-same" if diagonal else "sm-moved"), "="
            elif normed:
                cls, mark = "sm-normed", "norm"
            else:
                cls, mark = ("sm-wrong" if diagonal else ""), ("≠" if diagonal else "")
            title = f"a slot {i} holds {esc(sa)}; b slot {j} holds {esc(sb)}"
            cells.append(f'<td class="sm-cell {cls}" title="{title}">{mark}</td>')
        body.append(f'<tr><th class="sm-row">a slot {i}: <code>{name(sa)}</code></th>{"".join(cells)}</tr>')
    caption = (f"Slots of <code>{esc(ev.tensor)}</code>: which target state each slot holds, a (rows) "
               f"against b (columns), from {ev.rows_checked} rows. Wired alike, every mark is a green = on "
               "the diagonal.")
    return (f'<figure class="slots"><figcaption>{caption}</figcaption><table class="slot-matrix">'
            f'<tr><th></th>{head}</tr>{"".join(body)}</table></figure>')


def tokens_html(view: TokenView) -> str:
    """Both sides' tokens, aligned by position; the first differing token and the first divergence's
    position marked."""
    count = max(len(view.tokens_a), len(view.tokens_b))
    if view.first_difference is not None:
        said = (f'The tokens first differ at position <b>{view.first_difference}</b> '
                '<span class="tok-key tok-first">marked</span>.')
    else:
        said = "The shown tokens agree on both sides."
    if view.focus is not None:
        said += (f" The first divergence's row is at position <b>{view.focus}</b> "
                 '<span class="tok-key tok-focus">outlined</span>.')
    lines = []
    for begin in range(0, count, TOKENS_PER_LINE):
        cols = []
        for k in range(begin, min(count, begin + TOKENS_PER_LINE)):
            pos = view.start + k
            ta = view.tokens_a[k] if k < len(view.tokens_a) else None
            tb = view.tokens_b[k] if k < len(view.tokens_b) else None
            cls = ["tok"]
            if pos == view.first_difference:
                cls.append("tok-first")
            elif ta is not None and tb is not None and ta != tb:
                cls.append("tok-diff")
            if pos == view.focus:
                cls.append("tok-focus")
            shown = "".join(f"<span>{'·' if tok is None else tok}</span>" for tok in (ta, tb))
            cols.append(f'<div class="{" ".join(cls)}"><span class="tok-pos">{pos}</span>{shown}</div>')
        lines.append('<div class="tok-line"><div class="tok tok-side"><span class="tok-pos">pos</span>'
                     f'<span>a</span><span>b</span></div>{"".join(cols)}</div>')
    who = f"request <code>{esc(view.request_a)}</code> on a, <code>{esc(view.request_b)}</code> on b"
    return (f'<p>{who}, positions {view.start}-{view.start + count - 1} ({len(view.tokens_a)} tokens on a, '
            f'{len(view.tokens_b)} on b; · none). {said}</p><div class="tokens">{"".join(lines)}</div>')


def _worst(t: TensorResult) -> str:
    return ", ".join(f"{k} {num(t.worst[k])}" for k in SHOWN if k in t.worst)


def tensor_table(report: Report) -> str:
    first = divergence(report)
    rows = []
    for t in report.tensors:
        c = t.coverage
        cls = ' class="row-first"' if first is not None and t.name == first.name else ""
        dtypes = "" if t.dtypes is None else " / ".join(esc(d) for d in t.dtypes)
        shapes = "" if t.shapes is None else " / ".join(esc(list(s)) for s in t.shapes)
        share = "" if c is None or c.fraction is None else f"{100 * c.fraction:.0f}%"
        rows.append(f"<tr{cls}><td><code>{esc(t.name)}</code></td>"
                    f'<td><span class="status st-{esc(t.status)}">{esc(t.status).replace("_", " ")}</span>'
                    "</td>"
                    f"<td>{dtypes}</td><td>{shapes}</td><td class=num>{'' if c is None else c.aligned}</td>"
                    f"<td class=num>{'' if c is None else f'{c.rows_a} / {c.rows_b}'}</td>"
                    f"<td class=num>{share}</td>"
                    f"<td class=num>{t.failed}</td><td>{_worst(t)}</td><td>{esc(t.note)}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("tensor", "status", "dtype a / b", "row shape a / b", "aligned",
                                              "rows a / b", "coverage", "failed", "worst", "note"))
    return f'<table class="tensors"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _value(value: Any) -> str:
    shown = json.dumps(value, default=str)
    if len(shown) > CONTRACT_CHARS:
        shown = shown[:CONTRACT_CHARS] + f"… ({len(shown)} characters)"
    return f"<code>{esc(shown)}</code>"


def contract_html(report: Report) -> str:
    c = report.contract
    out = []
    if c.differing:
        rows = "".join(f"<tr><td><code>{esc(e.key)}</code></td><td>{_value(e.a)}</td><td>{_value(e.b)}</td>"
                       f"<td>{esc(what)}</td></tr>" for e, what in contract_differences(report))
        head = "".join(f"<th>{h}</th>" for h in ("key", "a", "b", "can change"))
        out.append(f'<table class="contract"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')
    else:
        out.append('<p class="muted">The run contracts state no key with different values.</p>')
    for side, keys in (("a", c.only_a), ("b", c.only_b)):
        if keys:
            items = "".join(f"<li><code>{esc(k)}</code> = {_value(v)}</li>" for k, v in keys.items())
            out.append(f"<details><summary>{len(keys)} keys only {side} states (not differences)</summary>"
                       f"<ul>{items}</ul></details>")
    return "".join(out)
