"""Scale or normalization: the sides point the same way but differ in length, by one constant
factor (scale), or one side is RMSNorm of the other with some per-channel weight (norm)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.diagnose.aux import CONCATENATED
from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.diagnose.norms import rms_norm_fit
from tracediff.diff.findings import Diagnosis, NormFitEvidence, ScaleEvidence, Side
from tracediff.diff.pair import Pair

MIN_ROWS = 4  # a per-channel weight fitted on fewer rows would explain anything
ALIGNED = 1e-4  # 1 - cosine below this: same direction
STEADY = 1e-3  # relative spread of the norm ratio below this: one constant factor
FITS = 1e-2  # rel_l2 of an RMSNorm fit below this: it is that norm


@dataclass(frozen=True)
class Lengths:
    """Rows of b against a's at the same positions: direction (cosine) and length (b over a)."""

    unit: Pair[np.ndarray]  # rows divided by their peak: squares of any float64 (1e300) cannot overflow
    cosine: np.ndarray
    ratio: np.ndarray

    @property
    def spread(self) -> float:
        return float(self.ratio.std() / self.ratio.mean())

    @property
    def scaled(self) -> bool:
        """One constant factor other than 1 between the sides, the same direction on every row."""
        return bool((1 - self.cosine).max() < ALIGNED and self.spread < STEADY
                    and abs(self.ratio.mean() - 1) > STEADY)


def lengths(x: Pair[np.ndarray]) -> Lengths | None:
    """``Lengths`` of decoded rows (float64 [n, -1], the same shape on both sides); None without a
    row, or with a row of zeros or NaN/Inf (nan_inf's to explain)."""
    if not len(x.a) or x.a.shape != x.b.shape:
        return None
    peaks = x.map(lambda v: np.abs(v).max(axis=1))
    if not all(bool(np.isfinite(p).all() and (p > 0).all()) for p in (peaks.a, peaks.b)):
        return None
    unit = x.zip(peaks).starmap(lambda v, peak: v / peak[:, None])
    norms = unit.map(lambda v: np.linalg.norm(v, axis=1))
    cosine = (unit.a * unit.b).sum(axis=1) / (norms.a * norms.b)
    return Lengths(unit, cosine, norms.b / norms.a * (peaks.b / peaks.a))


def scale_or_norm(ctx: Context) -> list[Diagnosis]:
    first, x = ctx.first, ctx.first_rows
    if first is None or x is None or first.name in CONCATENATED:
        return []  # concatenated inputs: a normed slot is the aux diagnosis's to name, per slot
    found = lengths(x)
    if found is None:
        return []
    labels = ctx.labels
    cosine, ratio, spread = found.cosine, found.ratio, found.spread
    evidence = ScaleEvidence(tensor=first.name, rows_checked=len(ratio), min_cosine=float(cosine.min()),
                             norm_ratio_b_over_a=float(ratio.mean()), ratio_spread=spread)
    if found.scaled:
        rows = "on every row" if len(ratio) > 1 else "on its one failing row"
        return [Diagnosis("scale", f"{first.name}: {labels.b} = {ratio.mean():.6g} x {labels.a} {rows} "
                          f"(cosine >= {cosine.min():.6f}): one side is scaled", evidence)]
    if len(ratio) < MIN_ROWS:
        return []
    # RMSNorm does not see its input's scale: the raw side is fitted as unit rows
    unit = found.unit
    candidates: tuple[tuple[np.ndarray, np.ndarray, Side], ...] = ((x.b, unit.a, "b"), (x.a, unit.b, "a"))
    for normed, raw, name in candidates:
        weight, fit = rms_norm_fit(raw, normed)
        if fit < FITS and spread >= STEADY:
            normed_label = getattr(labels, name)
            raw_label = labels.a if name == "b" else labels.b
            return [Diagnosis("norm", f"{first.name}: {normed_label} equals RMSNorm({raw_label}) "
                              f"(fit rel_l2 {fit:.2g} over {len(ratio)} rows): a norm is applied on one side "
                              "only", NormFitEvidence(**vars(evidence), normed_side=name, fit_rel_l2=fit,
                                                      weight_mean=float(weight.mean())))]
    return []
