"""The draft-to-target vocab map: d2t holds OFFSETS (target = draft + d2t[draft]), t2d a mask.

Works on numpy arrays (no torch needed), so compare/doctor can use it on recorded tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OFFSET, DIRECT = "offset", "direct"  # the two readings of d2t: target = draft + d2t[draft], or d2t[draft]


def draft_to_target(draft_ids: np.ndarray, d2t: np.ndarray) -> np.ndarray:
    """Target ids of draft ids under the offset reading (SpecForge, SGLang)."""
    draft_ids = np.asarray(draft_ids)
    return draft_ids + np.asarray(d2t)[draft_ids]


def build_vocab_map(token_counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) keeping the ``draft_vocab_size`` most frequent target tokens, in id order.

    Ties break toward the lower id, so the map is a pure function of the counts.
    """
    counts = np.asarray(token_counts)
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    kept = np.sort(order[:draft_vocab_size])
    t2d = np.zeros(len(counts), dtype=bool)
    t2d[kept] = True
    return (kept - np.arange(draft_vocab_size)).astype(np.int64), t2d


@dataclass(frozen=True)
class Finding:
    """One problem found, with what to do about it. ``code`` is a stable identifier."""

    severity: str  # "error" | "warning" | "info"
    code: str
    message: str
    fix: str


def check_vocab_map(d2t: np.ndarray | None, t2d: np.ndarray | None, vocab_size: int) -> list[Finding]:
    """Everything wrong with a (d2t, t2d) pair, including the known misuses; [] when healthy."""
    if d2t is None:
        return [Finding("error", "d2t_missing", "the checkpoint has no d2t: engines map draft id i to target "
                        "id i, so every drafted token is wrong unless the draft vocab is the full vocab",
                        "export d2t (and t2d) with the draft, from the same token counts as training")]
    d2t = np.asarray(d2t, dtype=np.int64)
    n = len(d2t)
    mapped = np.arange(n) + d2t
    findings = []
    if n < vocab_size and not d2t.any():
        findings.append(Finding("error", "d2t_zero", f"d2t is all zeros: draft ids map to the first {n} "
                                "target ids, whatever tokens the draft was trained on",
                                "regenerate d2t from the training token counts"))
    elif n > 1 and np.array_equal(d2t, np.arange(n)):
        findings.append(Finding("error", "d2t_arange", "d2t equals arange: draft id i maps to target id 2i",
                                "d2t must hold offsets from the kept target ids (kept - arange)"))
    elif n > 1 and looks_like_ids(d2t, vocab_size):
        findings.append(Finding("error", "d2t_holds_ids", "d2t holds target ids, not offsets: read as "
                                "offsets (target = draft + d2t[draft]) it maps past the kept tokens",
                                "store d2t = kept_ids - arange(draft_vocab_size)"))
    if mapped.min(initial=0) < 0 or mapped.max(initial=0) >= vocab_size:
        findings.append(Finding("error", "d2t_out_of_range", f"draft ids map to target ids outside "
                                f"[0, {vocab_size}): {int(mapped.min())}..{int(mapped.max())}",
                                "d2t was built for another target vocab"))
    elif n > 1 and not (np.diff(mapped) > 0).all():
        findings.append(Finding("error", "d2t_not_monotone", "arange + d2t is not strictly increasing: two "
                                "draft ids map to the same target id or the order is broken",
                                "regenerate d2t: kept ids sorted ascending"))
    if t2d is None:
        findings.append(Finding("warning", "t2d_missing", "the checkpoint has no t2d (SGLang ignores it; "
                                "training needs it)", "export t2d alongside d2t"))
    else:
        t2d = np.asarray(t2d, dtype=bool)
        if len(t2d) != vocab_size or int(t2d.sum()) != n or not np.array_equal(np.flatnonzero(t2d), mapped):
            findings.append(Finding("error", "t2d_inconsistent", f"t2d ({int(t2d.sum())} of {len(t2d)} kept) "
                                    "does not mark exactly the target ids arange + d2t",
                                    "d2t and t2d come from different vocab maps: regenerate both together"))
    return findings


def looks_like_ids(d2t: np.ndarray, vocab_size: int) -> bool:
    """A d2t that is itself a sorted list of target ids (the direct-map misuse of the format)."""
    d2t = np.asarray(d2t)
    return bool(d2t[0] >= 0 and (np.diff(d2t) > 0).all() and d2t[-1] < vocab_size
                and (np.arange(len(d2t)) + d2t)[-1] >= vocab_size)


def infer_mapping(draft_ids: np.ndarray, target_ids: np.ndarray, d2t: np.ndarray) -> str:
    """How a producer turned draft ids into target ids: 'offset', 'direct' (d2t[draft]) or 'unknown'."""
    draft_ids, target_ids, d2t = np.asarray(draft_ids), np.asarray(target_ids), np.asarray(d2t)
    offset = draft_to_target(draft_ids, d2t)
    direct = d2t[draft_ids]
    if np.array_equal(offset, target_ids):
        return OFFSET
    if np.array_equal(direct, target_ids):
        return DIRECT
    return "unknown"
