"""Config differences as causes: the contract keys whose difference can change the first diverging
tensor (``CAUSES`` in tracediff/diff/contract_diff.py), best first by the error profile they leave
(a rope difference leaves row 0 untouched and an error growing with position; a norm epsilon an
error from the first row on), then the differing keys that cannot explain it, as such: aux ids and
their reading where both sides state the same ``aux_sources`` among them. Keys whose effect is
precision only are left to the ``precision`` diagnosis."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.contract_diff import UNKNOWN, cause_of, is_target_fact, moot
from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.findings import ConfigBystandersEvidence, ConfigCauseEvidence, Diagnosis
from tracediff.diff.results import ContractDiff, ContractEntry, Profile

GROWS = "grows_with_position"
FROM_0 = "from_position_0"
RANK_CORRELATION = 0.0  # error vs position over the cells must exceed this, for an error that grows
GROWTH = 4.0  # from_position_0: an error growing this much from the first cell is not flat
PROFILE_TEXT = {GROWS: "the error starts after position 0 and grows with position",
                FROM_0: "the error is there from position 0 on, without growing with position"}


@dataclass(frozen=True)
class Candidate:
    entry: ContractEntry
    effect: str
    fits: bool | None  # the profile its effect leaves is the observed one (None: it leaves none)


def config_causes(ctx: Context) -> list[Diagnosis]:
    comparison, first = ctx.comparison, ctx.first
    if first is None:
        return []
    observed = error_profile(first.profile)
    candidates, bystanders, unknown = [], [], []
    diff = comparison.contract
    for entry in diff.differing:
        cause = cause_of(entry.key)
        if is_target_fact(entry.key) or cause.effect == "precision":
            continue  # the verdict's and the precision diagnosis's to judge
        if cause is UNKNOWN:
            unknown.append(entry.key)
        elif cause.changes(entry.key, first.name) and not moot(entry.key, diff):
            fits = None if not cause.profile or not observed else cause.profile == observed
            candidates.append(Candidate(entry, cause.effect, fits))
        else:
            bystanders.append(entry.key)
    if not candidates:
        return []
    candidates.sort(key=lambda c: {True: 0, None: 1, False: 2}[c.fits])
    by_effect: dict[str, list[Candidate]] = {}  # one setting stated several ways is one cause
    for c in candidates:
        by_effect.setdefault(c.effect, []).append(c)
    found = [_diagnosis(first.name, same[0], observed, [c.entry.key for c in same[1:]])
             for same in by_effect.values()]
    if bystanders or unknown:
        found.append(Diagnosis(
            "config", _bystanders_text(first.name, bystanders, unknown, diff),
            ConfigBystandersEvidence(first.name, bystanders, unknown), severity="info"))
    return found


def _diagnosis(tensor: str, c: Candidate, observed: str, also: list[str]) -> Diagnosis:
    """One cause: the best-fitting key of an effect; ``also``: the other differing keys of that
    effect (the same setting as each producer states it: aux ids, resolved ids, sources)."""
    cause, e = cause_of(c.entry.key), c.entry
    text = f"{e.key} differs (a {e.a!r}, b {e.b!r}): {cause.effect} settings change {cause.what}, " \
           f"{tensor} among them"
    if also:
        text += f" (differing too: {', '.join(also)})"
    if c.fits is True:
        text += f"; {PROFILE_TEXT[observed]}, as a {cause.effect} difference's does"
    elif c.fits is False:
        text += f"; but {PROFILE_TEXT[observed]}, which a {cause.effect} difference does not leave"
    evidence = ConfigCauseEvidence(tensor, e.key, e.a, e.b, cause.effect, observed, c.fits)
    return Diagnosis("config", text, evidence, severity="warning" if c.fits is False else "error")


def _bystanders_text(tensor: str, bystanders: list[str], unknown: list[str], diff: ContractDiff) -> str:
    def why(key: str) -> str:
        return cause_of(key).effect + (": both sides feed the same states" if moot(key, diff) else "")

    parts = []
    if bystanders:
        parts.append(f"contract differences that cannot explain {tensor}: "
                     + ", ".join(f"{k} ({why(k)})" for k in bystanders))
    if unknown:
        parts.append("differing keys whose effect tracediff does not know: " + ", ".join(unknown))
    return "; ".join(parts)


def error_profile(profile: Profile | None) -> str:
    """``GROWS``: at the lowest depth, the position-0 cell (one position wide) is within tolerance,
    a later one is not, and the error rises with position (a rank correlation above
    ``RANK_CORRELATION``): RoPE leaves position 0 unrotated, so a rope difference is nil there and
    appears after it, not always monotonically (rotations are periodic; a cell's worst row mixes
    requests). ``FROM_0``: the first cell fails and the error does not grow (the largest cell under
    ``GROWTH`` times the first). Empty otherwise, or without a profile."""
    if profile is None or not profile.depth:
        return ""
    depth = min(profile.depth)
    cells = [(p, f, e) for d, p, n, f, e in zip(profile.depth, profile.position, profile.rows, profile.failed,
                                                 profile.rel_l2) if d == depth and n and e is not None]
    failing = [i for i, (_, f, _) in enumerate(cells) if f]
    if len(cells) < 3 or not failing:
        return ""
    errors = np.array([e for _, _, e in cells])
    rising = _rank_correlation(np.array([p for p, _, _ in cells]), errors) > RANK_CORRELATION
    if failing[0] > 0 and cells[0][0] == 0 and profile.bucket == 1 and rising:
        return GROWS
    if failing[0] == 0 and cells[0][0] == 0 and not (rising and errors.max() >= GROWTH * errors[0]):
        return FROM_0
    return ""


def _rank_correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (0 when either side is constant)."""
    rx, ry = (np.argsort(np.argsort(v, kind="stable")).astype(float) for v in (x, y))
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])
