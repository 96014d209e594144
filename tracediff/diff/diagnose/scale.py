"""Scale or normalization: the sides point the same way but differ in length, by one constant
factor (scale), or one side is RMSNorm of the other with some per-channel weight (norm)."""

from __future__ import annotations

import numpy as np

from tracediff.diff.diagnose.aux import CONCATENATED
from tracediff.diff.diagnose.evidence import failing_sample, side_labels, values
from tracediff.diff.diagnose.norms import rms_norm_fit
from tracediff.diff.differ import Comparison
from tracediff.diff.findings import Diagnosis, NormFitEvidence, ScaleEvidence, Side
from tracediff.diff.pair import Pair
from tracediff.trace.dtypes import FLOAT_TAGS
from tracediff.trace.reader import Trace

SAMPLE_ROWS = 32
MIN_ROWS = 4  # a per-channel weight fitted on fewer rows would explain anything
ALIGNED = 1e-4  # 1 - cosine below this: same direction
STEADY = 1e-3  # relative spread of the norm ratio below this: one constant factor
FITS = 1e-2  # rel_l2 of an RMSNorm fit below this: it is that norm


def scale_or_norm(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    first = comparison.first_divergence
    if first is None or first.name in CONCATENATED or not all(d in FLOAT_TAGS for d in first.dtypes or ()):
        return []  # concatenated inputs: a normed slot is the aux diagnosis's to name, per slot
    tensor = next(t for t in comparison.plan.tensors if t.name == first.name)
    rows = failing_sample(comparison, first.name).map(lambda r: r[:SAMPLE_ROWS])
    x = Pair(values(traces.a, tensor.keys.a, rows.a), values(traces.b, tensor.keys.b, rows.b))
    if len(x.a) < 2 or x.a.shape != x.b.shape:
        return []
    labels = side_labels(traces)
    peaks = x.map(lambda v: np.abs(v).max(axis=1))
    usable = peaks.map(lambda p: bool(np.isfinite(p).all() and (p > 0).all()))
    if not (usable.a and usable.b):  # a row of zeros, or NaN/Inf (nan_inf's to explain)
        return []
    # Rows divided by their peak: squares of float64 values of any size (1e300) cannot overflow.
    unit = x.zip(peaks).starmap(lambda v, peak: v / peak[:, None])
    norms = unit.map(lambda v: np.linalg.norm(v, axis=1))
    cosine = (unit.a * unit.b).sum(axis=1) / (norms.a * norms.b)
    ratio = norms.b / norms.a * (peaks.b / peaks.a)
    spread = float(ratio.std() / ratio.mean())
    evidence = ScaleEvidence(tensor=first.name, rows_checked=len(ratio), min_cosine=float(cosine.min()),
                             norm_ratio_b_over_a=float(ratio.mean()), ratio_spread=spread)
    if (1 - cosine).max() < ALIGNED and spread < STEADY and abs(ratio.mean() - 1) > STEADY:
        return [Diagnosis("scale", f"{first.name}: {labels.b} = {ratio.mean():.6g} x {labels.a} on every row "
                          f"(cosine >= {cosine.min():.6f}): one side is scaled", evidence)]
    if len(ratio) < MIN_ROWS:
        return []
    # RMSNorm does not see its input's scale: the raw side is fitted as unit rows
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
