"""The aux slot matching (tracediff/diff/diagnose/aux.py) rests only on finite rows: a NaN made in
one target layer on one side spreads through attention to other positions of later layers, and NaN
rows would equal any state NaN there; too few finite rows are said, not guessed (issue 36).

Real states of a tiny 6-layer HF Llama, both sides recorded with the recorder, one side with a NaN
written into one layer's output by a forward hook. The sides feed the draft alike,
``[embed, layer 2, layer 5]``; issue 36's trial saw ``serving fed [embed, layer 2, layer 4],
training fed [embed, layer 2, layer 5]``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402
from tracediff.diff.diagnose.norms import MIN_ROWS  # noqa: E402
from tracediff.eagle3.capture import AuxSpec, run_target  # noqa: E402

REQUESTS = {"r0": [3, 17, 250, 9, 88, 41, 7, 300, 12, 5, 99, 64],
            "r1": [8, 2, 400, 33, 71, 6, 150, 19, 27, 301]}
AUX = AuxSpec((-1, 2, 5))  # [embed, layer 2, layer 5]
WIRED = ["target.embed", "target.layer.2", "target.layer.5"]
AUX_KINDS = {"aux_layer_set", "aux_order", "layer_offset", "norm"}


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(seed=4, layers=6)
    with torch.no_grad():  # a final norm weight no unit weight passes for: only a fitted one names it
        model.model.norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.5)
    return model


@pytest.fixture(scope="module")
def training(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("training") / "training.h5"
    record(path, model, "training")
    return path


def record(path, model, source: str, aux: AuxSpec = AUX, final_norm: bool = False,
           requests: tuple[str, ...] = tuple(REQUESTS)) -> None:
    """Each request's target states and target.aux; ``final_norm``: its last slot after the final
    norm (HF's hidden_states[-1] taken as the last layer)."""
    with td.record(path, source=source) as rec, torch.no_grad():
        for request in requests:
            tokens = REQUESTS[request]
            states = run_target(model, torch.tensor([tokens]))
            slots = [states.states[name] for name in aux.sources()]
            if final_norm:
                slots[-1] = model.model.norm(slots[-1])
            for name, value in states.states.items():
                rec.log(name, value[0], token_ids=tokens, request=request)
            rec.log("target.aux", torch.cat(slots, dim=-1)[0], token_ids=tokens, request=request)


@contextmanager
def nan_in(model, layer: str, request: str, position: int, on: bool = False) -> Iterator[None]:
    """One NaN in ``layer``'s output (``embed`` or a layer number) at one position of one request
    (``on``: at that position and every later one)."""
    inner = model.model
    module = inner.embed_tokens if layer == "embed" else inner.layers[int(layer)]

    def poison(m, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.shape[1] == len(REQUESTS[request]):
            hidden[0, slice(position, None) if on else position, 1] = float("nan")
        return out

    handle = module.register_forward_hook(poison)
    try:
        yield
    finally:
        handle.remove()


def compare(a, b) -> tuple[int, dict]:
    report = td.compare(a, b)
    return report.exit_code, json.loads(report.to_json())


def found(report: dict, kind: str, severity: str) -> list[dict]:
    return [d for d in report["diagnoses"] if (d["kind"], d["severity"]) == (kind, severity)]


@pytest.mark.parametrize(("layer", "request_id", "position"), [
    ("3", "r0", 4),  # between the aux layers, mid-sequence: the trial's case
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("embed", "r0", 0),  # the first aux state, at the first position
        ("2", "r0", 6),  # the first aux layer
        ("5", "r0", 4),  # the last aux layer
        ("1", "r1", 0),  # before every aux layer, another request, the first position
        ("0", "r1", 7),
    ]),
])
def test_a_nan_spread_through_attention_accuses_no_wiring(model, training, tmp_path, layer, request_id,
                                                          position) -> None:
    with nan_in(model, layer, request_id, position):
        record(tmp_path / "serving.h5", model, "serving")
    code, report = compare(training, tmp_path / "serving.h5")
    name = "target.embed" if layer == "embed" else f"target.layer.{layer}"
    first = report["first_divergence"]
    assert code == 1 and (first["name"], first["row"]["position"]) == (name, position)
    [nan] = found(report, "nan_inf", "error")
    assert (nan["evidence"]["tensor"], nan["evidence"]["side"]) == (name, "b")
    assert (nan["evidence"]["request"], nan["evidence"]["position"]) == (request_id, position)
    assert not AUX_KINDS & {d["kind"] for d in report["diagnoses"]}, report["diagnoses"]
    [note] = found(report, "nan_inf", "info")
    assert note["message"].startswith("target.aux: too few finite rows to match slots (0): ")
    assert note["evidence"] == {"tensor": "target.aux", "rows_checked": note["evidence"]["rows_checked"],
                                "rows_finite": 0, "rows_needed": 1}


def test_a_wiring_difference_is_still_named_on_the_finite_rows(model, training, tmp_path) -> None:
    """Serving also feeds layer 4 where training feeds layer 5: r0 is NaN from layer 3 on, r1 is
    finite; the difference is named from r1's rows alone."""
    with nan_in(model, "3", "r0", 4):
        record(tmp_path / "serving.h5", model, "serving", aux=AuxSpec((-1, 2, 4)))
    code, report = compare(training, tmp_path / "serving.h5")
    assert code == 1
    [wiring] = [d for d in report["diagnoses"] if d["kind"] in AUX_KINDS]
    assert (wiring["kind"], wiring["severity"]) == ("aux_layer_set", "error")
    assert wiring["message"] == ("aux layer set differs: serving fed [embed, layer 2, layer 4], "
                                 "training fed [embed, layer 2, layer 5]")
    evidence = wiring["evidence"]
    assert evidence["slots_a"] == WIRED and evidence["slots_b"] == [*WIRED[:2], "target.layer.4"]
    assert evidence["rows_checked"] == len(REQUESTS["r1"])  # r0's rows hold NaN: left out


def test_too_few_finite_rows_to_call_a_slot_unknown_are_said(model, tmp_path) -> None:
    """Serving takes the last layer after the final norm (an unrecorded weight: only a fit over
    MIN_ROWS rows names it), and its last layer overflows from position 3 on: 3 finite rows cannot
    tell a normed state from no state, so the slot is not called unknown."""
    record(tmp_path / "training.h5", model, "training", requests=("r0",))
    record(tmp_path / "whole.h5", model, "serving", final_norm=True, requests=("r0",))
    code, report = compare(tmp_path / "training.h5", tmp_path / "whole.h5")  # finite: the fit names it
    named = [(d["kind"], d["evidence"]["weight"]) for d in report["diagnoses"]]
    assert code == 1 and named == [("norm", "fitted")]
    with nan_in(model, "5", "r0", 3, on=True):
        record(tmp_path / "serving.h5", model, "serving", final_norm=True, requests=("r0",))
    code, report = compare(tmp_path / "training.h5", tmp_path / "serving.h5")
    assert code == 1 and not AUX_KINDS & {d["kind"] for d in report["diagnoses"]}, report["diagnoses"]
    [note] = found(report, "nan_inf", "info")
    assert note["message"] == ("target.aux: too few finite rows to match slots (3): of the 12 failing rows "
                               "sampled, 3 are finite in target.aux and in every target state on both "
                               f"sides, {MIN_ROWS} needed; the wiring is not judged")
    assert note["evidence"] == {"tensor": "target.aux", "rows_checked": 12, "rows_finite": 3,
                                "rows_needed": MIN_ROWS}
