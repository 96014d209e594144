"""Concatenated inputs (target.aux, draft.fc_in): which recorded target state fills each slot.

Each side's slots are matched against that side's own target.embed / target.layer.i at the same
rows, so the answer does not depend on the other side being right. A slot equal to none of them is
tried as a norm of each (norms.py: RMSNorm or LayerNorm with a recorded, unit or fitted weight),
since real bugs feed a normed state: the last layer after the final norm (HF's
``hidden_states[-1]``), fc_norm on one side only. Such a slot is named ``norm(target.layer.i)``.

Slots are matched only on the sampled rows where the input and every candidate state are finite
on both sides: a NaN spreads through attention to other positions of later layers, and all-NaN rows
would equal any all-NaN state. One such row decides equality and a recorded or unit-weight norm (they
hold or fail row by row); a slot none of them names is called unknown only on MIN_ROWS rows (what a
fitted weight needs) when NaN/Inf took rows away. With fewer, the slots are not matched and an
``info`` says so (``nan_inf``: the NaN/Inf are the difference to explain, not the wiring).

What a producer measured a slot to hold (``aux_slot_states`` in its contract: SGLang's recorder
matches every slot once, against the residual stream and each layer's branch output) names the slot
where the data alone cannot: a layer's branch output is recorded nowhere else. ``aux_quirks`` names,
on every compare where the aux does not match, what one side's own contract and aux show: slots
holding branch outputs, a slot count other than the draft's fc takes, a state named twice. A
difference is said with the family's id convention where the contract names the family.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.diagnose.evidence import values as evidence_values
from tracediff.diff.diagnose.norms import (
    FINAL_NORMS,
    LAYER,
    MIN_ROWS,
    RMS,
    Affine,
    NormFit,
    norm_fit,
    recorded_weights,
)
from tracediff.diff.findings import (
    CaptureQuirkEvidence,
    Diagnosis,
    NormedSide,
    Side,
    SlotNormEvidence,
    SlotsEvidence,
    SlotsUnmatchedEvidence,
)
from tracediff.diff.metrics import float_metrics
from tracediff.diff.pair import Pair
from tracediff.eagle3.conventions import (
    FAMILIES,
    RULES,
    VLLM,
    VLLM_LABEL,
    VLLM_RULE,
    Capture,
    label,
    labels,
    target_for,
)
from tracediff.eagle3.names import DRAFT_FC_IN, TARGET_AUX, TARGET_EMBED
from tracediff.eagle3.versions import SGLANG_VERSION, SPECFORGE_VERSION, VLLM_VERSION, minor
from tracediff.trace.reader import RowKeys, Trace

CONCATENATED = (TARGET_AUX, DRAFT_FC_IN)
SAME = 1e-4  # max_rel below which a slot is taken to be that state
NORM_LABELS = {RMS: "RMSNorm", LAYER: "LayerNorm"}


def layer_number(name: str) -> int:
    """target.embed -> -1 (the input of layer 0), target.layer.i (and its .branch) -> i."""
    return -1 if name == TARGET_EMBED else int(name.split(".")[2])


@dataclass(frozen=True)
class Slot:
    """What one slot holds: a recorded target state (None: none found), maybe after a norm."""

    source: str | None = None
    norm: NormFit | None = None

    @property
    def name(self) -> str | None:
        """Canonical name for the evidence: ``target.layer.5``, ``norm(target.layer.5)`` or None."""
        return f"norm({self.source})" if self.norm and self.source else self.source

    @property
    def label(self) -> str:
        """For people: ``layer 5``, ``RMSNorm(layer 5)``, ``embed``, ``?``."""
        if self.source is None:
            return "?"
        state = label(self.source)
        return f"{NORM_LABELS[self.norm.norm]}({state})" if self.norm else state


@dataclass(frozen=True)
class Sampled:
    """One side's sampled rows of a concatenated input (``values``, [rows, K*H]) and every target
    state of that side at the same (request, position), by name ([rows, H] each)."""

    values: np.ndarray
    states: dict[str, np.ndarray]

    @classmethod
    def of(cls, trace: Trace, keys: RowKeys, picked: np.ndarray, known: dict[str, RowKeys]) -> Sampled:
        return cls(evidence_values(trace, keys, picked), _states_at(trace, keys, picked, known))

    @property
    def finite(self) -> np.ndarray:
        """Per row: the input and every state hold no NaN/Inf there."""
        rows = (self.values, *self.states.values())
        return np.logical_and.reduce([np.isfinite(r).all(axis=1) for r in rows])

    def rows(self, kept: np.ndarray) -> Sampled:
        """The rows ``kept`` (bool per row)."""
        return Sampled(self.values[kept], {name: state[kept] for name, state in self.states.items()})


def slot_sources(sampled: Sampled, weights: dict[str, Affine] | None = None) -> list[Slot]:
    """For each slot of the concatenated rows, the target state (embed or layer output) of the same
    trace at the same (request, position) that it equals, else the one it is a norm of (``weights``:
    recorded norm weights to try first); [] when the slots cannot be cut. The rows must be finite."""
    values, candidates = sampled.values, sampled.states
    widths = {c.shape[1] for c in candidates.values()}
    if len(widths) != 1 or values.shape[1] % (width := widths.pop()):
        return []
    slots = (values[:, k * width : (k + 1) * width] for k in range(values.shape[1] // width))
    return [_equal(slot, candidates) or _normed(slot, candidates, weights or {}) for slot in slots]


def _states_at(trace: Trace, keys: RowKeys, picked: np.ndarray,
               known: dict[str, RowKeys]) -> dict[str, np.ndarray]:
    """Every target.embed / target.layer.i of the trace at the (request, position) of ``picked``
    (depth 0), by name; states missing any of those rows are left out."""
    at = list(zip(keys.request[picked].tolist(), keys.position[picked].tolist()))
    candidates = {}
    for name, state in known.items():
        if name != TARGET_EMBED and not name.startswith("target.layer."):
            continue
        where: dict[tuple, int] = {}
        for i, key in enumerate(zip(state.request.tolist(), state.position.tolist())):
            if state.depth[i] == 0:
                where.setdefault(key, i)
        found = [where.get(key) for key in at]
        if None not in found:
            candidates[name] = evidence_values(trace, state, np.array(found))
    return candidates


def _equal(slot: np.ndarray, candidates: dict[str, np.ndarray]) -> Slot | None:
    name = next((name for name, state in candidates.items() if _holds(slot, state)), None)
    return None if name is None else Slot(name)


def _holds(slot: np.ndarray, state: np.ndarray) -> bool:
    """``slot`` is ``state``: every element within SAME."""
    return bool((float_metrics(state, slot)["max_rel"] < SAME).all())


def _normed(slot: np.ndarray, candidates: dict[str, np.ndarray], weights: dict[str, Affine]) -> Slot:
    """The candidate whose norm fits the slot best, or an unknown slot."""
    fits = [(fit.rel_l2, name, fit) for name, state in candidates.items()
            if (fit := norm_fit(state, slot, weights)) is not None]
    if not fits:
        return Slot()
    _, name, fit = min(fits, key=lambda f: f[0])
    return Slot(name, fit)


def aux_slots(ctx: Context) -> list[Diagnosis]:
    comparison, traces, first = ctx.comparison, ctx.traces, ctx.first
    failing = ("diverged", "downstream")
    names = [t.name for t in comparison.tensors if t.name in CONCATENATED and t.status in failing]
    if first is None or not names:
        return []
    name = names[0]
    plan = comparison.plan
    tensor = ctx.tensor(name)
    picked = ctx.sample(name)
    sampled = Pair(Sampled.of(traces.a, tensor.keys.a, picked.a, plan.keys.a),
                   Sampled.of(traces.b, tensor.keys.b, picked.b, plan.keys.b))
    finite = sampled.a.finite & sampled.b.finite
    if not finite.any():
        return [_unmatched(name, finite, 1)]
    weights = traces.map(recorded_weights)  # the same model's norms: either side's record will do
    weights = Pair({**weights.b, **weights.a}, {**weights.a, **weights.b})
    slots = sampled.map(lambda s: s.rows(finite)).zip(weights).starmap(slot_sources)
    if name == TARGET_AUX:
        slots = Pair(_measured(traces.a, slots.a), _measured(traces.b, slots.b))
    enough = min(MIN_ROWS, len(finite))  # all the rows sampled, when fewer and every one finite
    if finite.sum() < enough and any(slot.source is None for slot in [*slots.a, *slots.b]):
        return [_unmatched(name, finite, enough)]
    if not slots.a or not slots.b or slots.a == slots.b:
        return []
    held = slots.map(lambda s: [slot.name for slot in s])
    evidence = SlotsEvidence(tensor=name, slots_a=held.a, slots_b=held.b, rows_checked=int(finite.sum()))
    last = max((layer_number(n) for n in {*plan.keys.a, *plan.keys.b} if n.startswith("target.layer.")),
                default=None)
    side = Pair(_described(traces.a, ctx.labels.a), _described(traces.b, ctx.labels.b))
    ruled: Pair[str] | Pair[_Ruled] = side
    ids = traces.map(_ids)
    if VLLM in (traces.a.engine, traces.b.engine):  # the engines' id rules say why the slots differ
        ruled, ids = Pair(_ruled(traces.a, ctx.labels.a), _ruled(traces.b, ctx.labels.b)), Pair("", "")
    return [*_layer_change(name, slots, ruled, evidence, ids, b_first=traces.a.engine != VLLM),
            *(_norm_change(name, *change, side, evidence, last) for change in _norm_only(slots))]


def _measured(trace: Trace, slots: list[Slot]) -> list[Slot]:
    """The slots as the producer measured them (``aux_slot_states``), where it measured one slot
    per slot the data was cut into; a slot it found equal to no state keeps what the data says."""
    states = trace.contract.get("aux_slot_states")
    if not isinstance(states, list) or len(states) != len(slots):
        return slots
    return [Slot(state) if isinstance(state, str) else slot for state, slot in zip(states, slots)]


def _described(trace: Trace, side: str) -> str:
    """``serving (deepseek_v2: +1 only when the first id is 1)``: the side, with its family's id
    convention where its contract names the family (vLLM's: the ids as given, in every family)."""
    if trace.engine == VLLM:
        return f"{side} ({_vllm_label(trace.contract)}: ids {VLLM_RULE})"
    capture = _capture(trace.contract)
    if capture is None:
        return side
    return f"{side} ({trace.contract['target_family']}: {RULES[capture.rule]})"


def _vllm_label(contract: dict) -> str:
    """``vLLM 0.32``, or the release the contract names where it is another."""
    version = contract.get("vllm_version")
    known = not isinstance(version, str) or version.startswith(minor(VLLM_VERSION))
    return VLLM_LABEL if known else f"vLLM {version}"


@dataclass(frozen=True)
class _Ruled:
    """How a side says what it fed, where one side is vLLM's: its engine's id rule, and its ids."""

    text: str  # ``serving: vLLM 0.32 feeds ids [1, 4, 6] as given:`` / ``training (SpecForge ...) fed``
    ids: tuple[int, ...] | None
    vllm: bool

    def fed(self, said: str, other_ids: tuple[int, ...] | None) -> str:
        if self.vllm:
            return f"{self.text} {said}"
        ids = "" if self.ids == other_ids or self.ids is None else f" for ids {list(self.ids)}"
        return f"{self.text} {said}{ids}"


def _ruled(trace: Trace, side: str) -> _Ruled:
    """A side in the words of its engine's id rule (``_Ruled``)."""
    contract = trace.contract
    given = contract.get("aux_layer_ids")
    ids = tuple(given) if isinstance(given, list) and all(isinstance(i, int) for i in given) else None
    if trace.engine == VLLM:
        return _Ruled(f"{side}: {_vllm_label(contract)} feeds {_vllm_asked(contract, ids)}:", ids, True)
    return _Ruled(f"{side}{_rule_of(trace)} fed", ids, False)


def _vllm_asked(contract: dict, ids: tuple[int, ...] | None) -> str:
    """``ids [1, 4, 6] as given``: the ids the server's target captured for (its
    ``aux_hidden_state_layers``), said against the draft config's where they are not those."""
    found = contract.get("aux_hidden_state_layers")
    used = sorted({int(k) for k in found}) if isinstance(found, list) and all(
        isinstance(k, int) for k in found) else None
    if used is None or (ids and sorted(set(ids)) == used):
        return f"ids {list(ids)} {VLLM_RULE}" if ids else "no ids (the default [2, L//2, L-3])"
    if not ids:
        return f"no ids: the default {used} {VLLM_RULE}"
    return (f"ids {used} {VLLM_RULE} (its aux_hidden_state_layers, not the draft config's ids {list(ids)}: "
            "vLLM's V2 model runner reads no eagle_config ids)")


def _rule_of(trace: Trace) -> str:
    """`` (SpecForge 0.2.0, through SGLang: ids + 1)`` / `` (SGLang 0.5.23, llama: ids + 1)``: the id
    rule a side's engine applied, as its contract says it; "" where it says none."""
    contract = trace.contract
    reading = contract.get("aux_layer_reading")
    capture = _capture(contract)
    if isinstance(reading, str) and "through sglang's " in reading:
        found = target_for(reading.split("through sglang's ", 1)[1].split(":")[0].strip())
        capture = found.capture if found is not None else capture
    rule = "" if capture is None else f": {RULES[capture.rule]}"
    if trace.engine == "specforge":
        if isinstance(reading, str) and reading.startswith("output of layer i"):
            return f" (SpecForge {SPECFORGE_VERSION}, HF hidden_states[i+1]: the output of layer i)"
        return f" (SpecForge {SPECFORGE_VERSION}, through SGLang{rule})"
    if trace.engine == "sglang":
        family = contract.get("target_family")
        return f" (SGLang {SGLANG_VERSION}{f', {family}' if family else ''}{rule})"
    return f" ({contract['target_family']}{rule})" if capture is not None else ""


def _capture(contract: dict) -> Capture | None:
    """The id rule and capture of the target class the contract names (its family's, else None)."""
    family = FAMILIES.get(str(contract.get("target_family")))
    if family is None:
        return None
    target = target_for(str(contract.get("target_model_class", "")).rsplit(".", 1)[-1])
    return target.capture if target is not None and target.family is family else family.captures[0]


def _ids(trace: Trace) -> str:
    """`` for ids [2, 3, 4]`` as the contract gives them (`` for no ids`` when it says none)."""
    contract = trace.contract
    if "aux_layer_ids" not in contract or "target_family" not in contract:
        return ""
    ids = contract["aux_layer_ids"]
    return " for no ids (the default)" if ids is None else f" for ids {list(ids)}"


def _unmatched(name: str, finite: np.ndarray, needed: int) -> Diagnosis:
    """Too few of the sampled rows are finite to match the slots on: said, not guessed."""
    kept = int(finite.sum())
    message = (f"{name}: too few finite rows to match slots ({kept}): of the {len(finite)} failing rows "
               f"sampled, {kept} are finite in {name} and in every target state on both sides, {needed} "
               "needed; the wiring is not judged")
    return Diagnosis("nan_inf", message, SlotsUnmatchedEvidence(
        tensor=name, rows_checked=len(finite), rows_finite=kept, rows_needed=needed), severity="info")


def _layer_change(name: str, slots: Pair[list[Slot]], side: Pair[str] | Pair[_Ruled], evidence: SlotsEvidence,
                  ids: Pair[str], b_first: bool = True) -> list[Diagnosis]:
    """aux_layer_set / aux_order / layer_offset from the slots' source states (a norm aside). Where
    a side is vLLM's (``side`` holds ``_Ruled``), each side is said with its engine's id rule, vLLM's
    first (``b_first``: b's)."""
    sources = slots.map(lambda s: [slot.source for slot in s])
    if sources.a == sources.b or _branch_only(sources):
        return []
    said = slots.map(lambda s: "[" + ", ".join(slot.label for slot in s) + "]")
    if isinstance(side.a, _Ruled) and isinstance(side.b, _Ruled):
        a, b = side.a, side.b
        first, then = (b.fed(said.b, a.ids), a.fed(said.a, b.ids)) if b_first else \
            (a.fed(said.a, b.ids), b.fed(said.b, a.ids))
        fed = f"{first}; {then}"
    elif ids.a or ids.b:  # a side whose contract names its family: said with its id convention
        fed = f"{side.b} fed {said.b}{ids.b}; {side.a} fed {said.a}{ids.a}"
    else:
        fed = f"{side.b} fed {said.b}, {side.a} fed {said.a}"
    unknown = slots.map(lambda s: any(slot.source is None for slot in s))
    if not unknown.a and not unknown.b:
        layers = sources.map(lambda s: [layer_number(n) for n in s if n is not None])
        shift = {b - a for a, b in zip(layers.a, layers.b)}
        if len(layers.a) == len(layers.b) and len(shift) == 1 and abs(shift.pop()) == 1:
            return [Diagnosis("layer_offset", f"every {name} slot is one layer apart: {fed} "
                              "(output-of-layer vs input-to-layer convention)", evidence)]
        if sorted(layers.a) == sorted(layers.b):
            return [Diagnosis("aux_order", f"same aux layers, other order: {fed}", evidence)]
    return [Diagnosis("aux_layer_set", f"aux layer set differs: {fed}", evidence)]


def _norm_only(slots: Pair[list[Slot]]) -> list[tuple[int, str, Pair[Slot], NormFit]]:
    """Slots holding the same state on both sides, normed differently: (slot, state, slots, a norm)."""
    return [(k, a.source, Pair(a, b), fit) for k, (a, b) in enumerate(zip(slots.a, slots.b))
            if a.source is not None and a.source == b.source and a != b and (fit := b.norm or a.norm)]


def _norm_change(name: str, k: int, source: str, slot: Pair[Slot], fit: NormFit, side: Pair[str],
                 evidence: SlotsEvidence, last: int | None) -> Diagnosis:
    """One slot normed on one side only (or differently on both)."""
    normed_side: NormedSide = "both" if slot.a.norm and slot.b.norm else "b" if slot.b.norm else "a"
    layer = layer_number(source)
    said = slot.map(lambda s: s.label + (f" ({s.norm.weight} weight)" if s.norm else ""))
    if normed_side != "both":
        said = slot.map(lambda s: s.label + (f" ({_why(fit, layer, last)})" if s.norm else ""))
    fed = Pair(f"{side.a} fed {said.a}", f"{side.b} fed {said.b}")
    first, then = (fed.a, fed.b) if normed_side == "a" else (fed.b, fed.a)
    return Diagnosis("norm", f"{name} slot {k}: {first}, {then}", SlotNormEvidence(
        tensor=name, slot=k, layer=layer, norm=fit.norm, weight=fit.weight, weight_name=fit.weight_name,
        fit_rel_l2=fit.rel_l2, normed_side=normed_side, slots_a=evidence.slots_a, slots_b=evidence.slots_b,
        rows_checked=evidence.rows_checked))


def _why(fit: NormFit, layer: int, last: int | None) -> str:
    """The likely cause, from the weight that fit and the layer."""
    weight = f"{fit.weight} weight" + (f" {fit.weight_name}" if fit.weight_name else "")
    if fit.weight_name in FINAL_NORMS or (fit.weight_name is None and layer == last):
        return f"final norm applied, {weight}: HF's hidden_states[-1] is the last layer after the final norm"
    if fit.weight_name and "fc_norm" in fit.weight_name:
        return f"fc_norm applied on one side only, {weight}"
    return f"a norm applied on one side only, {weight}"


def _branch_only(sources: Pair[list[str | None]]) -> bool:
    """The sides differ only where one holds a layer's branch output and the other that layer's
    stream (``aux_branch`` names it)."""
    plain = sources.map(lambda s: [None if n is None else n.removesuffix(".branch") for n in s])
    branch = any(n is not None and n.endswith(".branch") for n in [*sources.a, *sources.b])
    return plain.a == plain.b and branch


# -- capture quirks, from one side's own contract and aux ------------------------------------------


@dataclass(frozen=True)
class Served:
    """What a side's contract and trace say of its aux: the boundaries SGLang was given and really
    captured, what each slot was measured to hold, and the slots the aux has and the draft's fc takes."""

    family: str | None
    ids: list[int] | None
    layers_to_capture: list[int]
    capture_layers: list[int]
    slot_states: list[str | None]
    slots: int | None  # target.aux's width over the target's hidden width
    slots_expected: int | None  # the draft's fc: its config's aux ids (3 without)
    num_layers: int | None
    capture: Capture | None  # the family's capture rules (conventions.py), where the contract names it

    @classmethod
    def of(cls, trace: Trace) -> Served:
        contract = trace.contract
        ids = contract.get("aux_layer_ids")
        draft = contract.get("draft_config")
        expected = None
        if isinstance(draft, dict):
            expected = len(ids) if isinstance(ids, list) and ids else 3
        layers = contract.get("target_num_layers")
        return cls(family=contract.get("target_family"), ids=ids if isinstance(ids, list) else None,
                   layers_to_capture=_ints(contract.get("layers_to_capture")),
                   capture_layers=_ints(contract.get("aux_capture_layers")),
                   slot_states=[s if isinstance(s, str) else None
                                for s in contract.get("aux_slot_states") or []],
                   slots=_slot_count(trace), slots_expected=expected,
                   num_layers=layers if isinstance(layers, int) else None, capture=_capture(contract))

    def reaches(self, k: int) -> bool:
        """Whether the family's forward can capture boundary k at all (the layer loop's k, and k = L
        where it looks after the loop); True where the contract does not say."""
        capture, layers = self.capture, self.num_layers
        if capture is None or layers is None or capture.flags:
            return True
        return 0 <= k < layers or (capture.after_loop and k == layers)

    def evidence(self, side: Side) -> CaptureQuirkEvidence:
        return CaptureQuirkEvidence(side=side, family=self.family, slot_states=self.slot_states,
                                    layers_to_capture=self.layers_to_capture,
                                    capture_layers=self.capture_layers,
                                    slots=self.slots, slots_expected=self.slots_expected)


def _ints(value: object) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        return []
    return [int(v) for v in value]


def _slot_count(trace: Trace) -> int | None:
    """target.aux's row width over the target's hidden width (a recorded target state's, else the
    contract's target config's)."""
    try:
        width = trace.keys(TARGET_AUX).row_shape
        hidden = next((trace.keys(n).row_shape[-1] for n in (TARGET_EMBED, "target.layer.0")
                       if n in trace.names()), None)
    except Exception:  # no aux, or records of mixed shapes: no count
        return None
    config = trace.contract.get("target_config")
    if hidden is None and isinstance(config, dict) and isinstance(config.get("hidden_size"), int):
        hidden = config["hidden_size"]
    if not width or not hidden or width[-1] % hidden:
        return None
    return width[-1] // hidden


def aux_quirks(ctx: Context) -> list[Diagnosis]:
    """On a compare where ``target.aux`` does not match: what each side's own capture shows (its
    contract's boundaries and measured slots, its aux's width)."""
    tensors = {t.name: t for t in ctx.comparison.tensors}
    if TARGET_AUX not in tensors or tensors[TARGET_AUX].status == "match":
        return []
    traces, named = ctx.traces, ctx.labels
    return [*_quirks("a", traces.a, named.a), *_quirks("b", traces.b, named.b)]


def _quirks(which: Side, trace: Trace, side: str) -> list[Diagnosis]:
    served = Served.of(trace)
    convention = _described(trace, side)
    found = []
    branches = [k for k, state in enumerate(served.slot_states) if state and state.endswith(".branch")]
    if branches:
        family = f" ({served.family} captures each layer's branch output)" if served.family else ""
        slots = f"slot{'s' if len(branches) > 1 else ''} {', '.join(map(str, branches))}"
        held = labels(served.slot_states)
        found.append(Diagnosis("aux_branch", f"{side}'s target.aux holds {held}: {slots} a layer's branch "
                               f"output, not the residual stream{family}: a draft trained on hidden states "
                               "is fed other inputs", served.evidence(which)))
    have, want = served.slots, served.slots_expected
    short = f"target.aux holds {have} slots, the draft's fc takes {want}" if have is not None and want else ""
    repeated = sorted({k for k in served.layers_to_capture if served.layers_to_capture.count(k) > 1})
    if repeated:
        twice = ", ".join(f"the input of layer {k}" for k in repeated)
        default = " (no ids: SGLang's default [2, L//2, L-3])" if served.ids is None else \
            f" (ids {served.ids})"
        found.append(Diagnosis("aux_duplicate", f"{convention}: layers_to_capture {served.layers_to_capture}"
                               f"{default} names {twice} twice; SGLang captures it once"
                               + (f": {short}" if short else ""), served.evidence(which)))
    elif short and have != want:
        found.append(Diagnosis("aux_slot_count", f"{convention}{_ids(trace)}: {short}{_why_count(served)}",
                               served.evidence(which)))
    return found


def _why_count(served: Served) -> str:
    """What the boundaries say of a slot count the draft's fc does not take."""
    ltc, captured = served.layers_to_capture, served.capture_layers
    stale = [k for k in captured if k not in ltc]
    if stale:
        return (f" (it captures {captured} where layers_to_capture says {ltc}: per-layer flags an earlier "
                "set_eagle3_layers_to_capture left set, never cleared)")
    never = [k for k in ltc if (captured and k not in captured) or not served.reaches(k)]
    if never:
        on = f" on {served.num_layers} layers" if served.num_layers else ""
        layers = ", ".join(map(str, never))
        return f" (layers_to_capture {ltc}: the input of layer {layers} is never captured{on})"
    return ""
