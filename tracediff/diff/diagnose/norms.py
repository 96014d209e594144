"""Norms a producer may apply to a hidden state before handing it on, and fits that tell whether it
did: RMSNorm or LayerNorm over the last axis, with a recorded, a unit or a fitted per-channel weight.
Real bugs feed a normed state where the other side feeds the raw one (HF's ``hidden_states[-1]`` is
the last layer after the final norm; fc_norm applied on one side only). A norm over several states
at once (norm_before_fc: one RMSNorm over the whole K*H row) is not a norm of any one state.

Recorded weights are static records (``Recorder.log_static``) whose name ends in ``norm.weight`` or
``norm.<k>.weight`` and whose width is the state's: ``target.norm.weight`` (HF ``model.norm``),
``target.final_norm.weight``, ``model.norm.weight``, ``draft.fc_norm.<k>.weight`` /
``fc_norm.<k>.weight`` (SpecForge's per-slot fc_norm), ``draft.midlayer.hidden_norm.weight`` and
the like. A LayerNorm's bias is the same name ending in ``bias``, when recorded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Final

import numpy as np

from tracediff.diff.findings import NormKind, WeightKind
from tracediff.trace.reader import Trace

RMS: Final = "rms"
LAYER: Final = "layer"
NORMS: tuple[NormKind, ...] = (RMS, LAYER)
RECORDED: Final = "recorded"
UNIT: Final = "unit"
FITTED: Final = "fitted"
FITS = 1e-2  # worst row's rel_l2 below this: it is that norm
MIN_ROWS = 8  # on fewer rows a fitted per-channel weight (and bias) could explain a state it is not
EPS = (1e-6, 1e-5)  # the epsilons in common use (Llama-style RMSNorm, torch LayerNorm)
WEIGHT_NAME = re.compile(r"norm(\.\d+)?\.weight$")
FINAL_NORMS = ("target.norm.weight", "target.final_norm.weight", "target.model.norm.weight",
               "model.norm.weight")

Predict = Callable[[np.ndarray, str], np.ndarray]  # (standardized rows, norm kind) -> normed rows


@dataclass(frozen=True)
class Affine:
    """A recorded norm's parameters."""

    weight: np.ndarray
    bias: np.ndarray | None = None


@dataclass(frozen=True)
class NormFit:
    """Which norm turns one state into another. Equal fits are the same norm and weight kind,
    whatever the fit error or the recorded weight's name."""

    norm: NormKind
    weight: WeightKind
    rel_l2: float = field(compare=False)  # worst row
    weight_name: str | None = field(default=None, compare=False)  # the recorded weight used


def standardize(raw: np.ndarray, norm: str, eps: float) -> np.ndarray:
    """Rows scaled to unit RMS (RMSNorm) or centred and scaled to unit variance (LayerNorm),
    before any weight."""
    if norm == LAYER:
        raw = raw - raw.mean(axis=1, keepdims=True)
    return raw / np.sqrt((raw**2).mean(axis=1, keepdims=True) + eps)


def worst_rel_l2(expected: np.ndarray, actual: np.ndarray) -> float:
    """max over rows of |actual - expected| / |actual|."""
    size = np.maximum(np.linalg.norm(actual, axis=1), np.finfo(float).tiny)
    return float((np.linalg.norm(actual - expected, axis=1) / size).max())


def channel_fit(unit: np.ndarray, normed: np.ndarray, bias: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares per-channel weight (and bias) mapping ``unit`` onto ``normed`` over the rows."""
    tiny = np.finfo(float).tiny
    if not bias:
        weight = (unit * normed).sum(axis=0) / np.maximum((unit**2).sum(axis=0), tiny)
        return weight, np.zeros_like(weight)
    du, dn = unit - unit.mean(axis=0), normed - normed.mean(axis=0)
    weight = (du * dn).sum(axis=0) / np.maximum((du**2).sum(axis=0), tiny)
    return weight, normed.mean(axis=0) - weight * unit.mean(axis=0)


def rms_norm_fit(raw: np.ndarray, normed: np.ndarray) -> tuple[np.ndarray, float]:
    """The per-channel weight w that best makes ``normed`` = w * raw / rms(raw), and the worst
    row's relative L2 error of that fit."""
    unit = standardize(raw, RMS, 0.0)
    weight, _ = channel_fit(unit, normed)
    return weight, worst_rel_l2(unit * weight, normed)


def recorded_weights(trace: Trace) -> dict[str, Affine]:
    """The trace's static norm weights (module docstring), by name."""
    out = {}
    for name in filter(WEIGHT_NAME.search, trace.names()):
        weight = _static(trace, name)
        if weight is not None and weight.ndim == 1:
            out[name] = Affine(weight, _static(trace, name[: -len("weight")] + "bias"))
    return out


def _static(trace: Trace, name: str) -> np.ndarray | None:
    """The last static record of ``name`` as float64, or None."""
    record = trace.last_static(name)
    if record is None:
        return None
    with np.errstate(invalid="ignore"):  # a signalling NaN is data: no warning when it is cast
        return record.numpy().astype(np.float64)


def norm_fit(raw: np.ndarray, normed: np.ndarray, recorded: dict[str, Affine]) -> NormFit | None:
    """The norm (RMS or Layer, over the epsilons in EPS) that turns rows ``raw`` into ``normed``:
    with a recorded weight, else a unit one, else one fitted over at least MIN_ROWS rows; None when
    none fits, or when ``raw`` already equals ``normed`` (that is no norm)."""
    if worst_rel_l2(raw, normed) < FITS:
        return None
    units = [(norm, standardize(raw, norm, eps)) for norm in NORMS for eps in EPS]
    for kind, name, predict in _weightings(recorded, normed):
        rel, norm = min((worst_rel_l2(predict(unit, norm), normed), norm) for norm, unit in units)
        if rel < FITS:
            return NormFit(norm, kind, rel, name)
    return None


def _weightings(recorded: dict[str, Affine],
                normed: np.ndarray) -> Iterator[tuple[WeightKind, str | None, Predict]]:
    """(weight kind, recorded name, predictor) in order of preference: the fewer free parameters,
    the stronger the evidence."""
    width = normed.shape[1]
    for name, affine in recorded.items():
        if len(affine.weight) == width and (affine.bias is None or len(affine.bias) == width):
            yield RECORDED, name, partial(_apply, affine)
    yield UNIT, None, lambda unit, norm: unit
    if len(normed) >= MIN_ROWS:
        yield FITTED, None, lambda unit, norm: _apply(_fitted(unit, normed, norm), unit, norm)


def _fitted(unit: np.ndarray, normed: np.ndarray, norm: str) -> Affine:
    """Per-channel weight (and, for LayerNorm, bias) fitted over the rows."""
    return Affine(*channel_fit(unit, normed, bias=norm == LAYER))


def _apply(affine: Affine, unit: np.ndarray, norm: str) -> np.ndarray:
    """Weight (and, for LayerNorm, bias) on standardized rows."""
    out = unit * affine.weight
    return out + affine.bias if norm == LAYER and affine.bias is not None else out
