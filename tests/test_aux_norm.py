"""Slots of a concatenated input (target.aux, draft.fc_in) that hold a NORMED target state: real
states of a tiny HF Llama (``output_hidden_states=True``; its ``hidden_states[-1]`` is the last
layer after the final norm), recorded as a training-like and a serving-like trace, compared and
diagnosed in process."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402
from tracediff.diff.diagnose import Diagnosis, diagnose  # noqa: E402
from tracediff.diff.diagnose.norms import FITTED, MIN_ROWS, RMS, norm_fit  # noqa: E402
from tracediff.diff.differ import compare_traces  # noqa: E402
from tracediff.diff.findings import SlotNormEvidence  # noqa: E402
from tracediff.diff.pair import Pair  # noqa: E402
from tracediff.diff.plan import make_plan  # noqa: E402

TOKENS = [3, 17, 250, 9, 88, 41, 7, 300, 12, 5, 99, 64]  # 12 rows: enough to fit a weight
LAYERS = 4
AUX = (0, 1, 3)  # training feeds [layer 0, layer 1, layer 3 (the last, before the final norm)]
TRAINED = ["target.layer.0", "target.layer.1", "target.layer.3"]


class States:
    """One forward of the tiny Llama: embedding, each layer's output (the last one taken by a hook,
    before the final norm), the final-normed last state and the final norm's weight."""

    def __init__(self) -> None:
        model = tiny_llama(seed=2, layers=LAYERS)
        with torch.no_grad():  # a non-trivial final norm weight, so a unit weight cannot pass for it
            model.model.norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.5)
        captured = {}
        handle = model.model.layers[-1].register_forward_hook(
            lambda m, a, out: captured.setdefault("last", out[0] if isinstance(out, tuple) else out))
        with torch.no_grad():
            hidden = model(torch.tensor([TOKENS]), output_hidden_states=True).hidden_states
        handle.remove()
        self.embed = hidden[0][0]
        self.layers = {i: hidden[i + 1][0] for i in range(LAYERS - 1)}
        self.layers[LAYERS - 1] = captured["last"][0]
        self.final = hidden[-1][0]  # RMSNorm(layer 3) with the final norm's weight
        self.norm_weight = model.model.norm.weight.detach().clone()
        assert not torch.allclose(self.final, self.layers[LAYERS - 1])


@pytest.fixture(scope="module")
def states() -> States:
    return States()


def record(path, source: str, states: States, slots: list, name: str = "target.aux",
           weight: bool = False) -> None:
    with td.record(path, source=source) as rec:
        if weight:
            rec.log_static("target.norm.weight", states.norm_weight)
        rec.log("target.embed", states.embed, token_ids=TOKENS, request="r0")
        for i, layer in states.layers.items():
            rec.log(f"target.layer.{i}", layer, token_ids=TOKENS, request="r0")
        rec.log(name, torch.cat(slots, dim=-1), token_ids=TOKENS, request="r0")


def training(tmp_path, states: States, name: str = "target.aux", weight: bool = False):
    record(tmp_path / "training.h5", "training", states, [states.layers[i] for i in AUX], name, weight)
    return tmp_path / "training.h5"


def diagnoses(a, b) -> list[Diagnosis]:
    with td.open_trace(a) as ta, td.open_trace(b) as tb:
        traces = Pair(ta, tb)
        comparison = compare_traces(traces, make_plan(traces))
        assert comparison.first_divergence is not None
        return diagnose(comparison, traces)


def kinds(found: list[Diagnosis]) -> list[str]:
    return [d.kind for d in found]


@pytest.mark.parametrize("name", ["target.aux", "draft.fc_in"])
@pytest.mark.parametrize(("recorded_on", "weight"), [((), "fitted"), (("a",), "recorded"),
                                                     (("a", "b"), "recorded")])
def test_last_aux_slot_after_the_final_norm(states, tmp_path, name, recorded_on, weight) -> None:
    """Serving takes HF's hidden_states[-1] as layer 3: slot 2 holds RMSNorm(layer 3). The final norm's
    weight is recorded on neither side (fitted), on training's only or on both (recorded)."""
    a = training(tmp_path, states, name, weight="a" in recorded_on)
    record(tmp_path / "serving.h5", "serving", states, [states.layers[0], states.layers[1], states.final],
           name, weight="b" in recorded_on)
    found = diagnoses(a, tmp_path / "serving.h5")
    assert kinds(found) == ["norm"], [d.message for d in found]
    evidence = found[0].evidence
    assert (evidence.tensor, evidence.slot, evidence.layer) == (name, 2, 3)
    assert (evidence.norm, evidence.weight, evidence.normed_side) == ("rms", weight, "b")
    assert evidence.weight_name == ("target.norm.weight" if weight == "recorded" else None)
    assert evidence.fit_rel_l2 < 1e-4 and evidence.rows_checked == len(TOKENS)
    assert evidence.slots_a == TRAINED
    assert evidence.slots_b == ["target.layer.0", "target.layer.1", "norm(target.layer.3)"]
    assert found[0].message.startswith(f"{name} slot 2: serving fed RMSNorm(layer 3) (final norm applied")
    assert found[0].message.endswith("training fed layer 3")


@pytest.mark.parametrize(("norm", "apply"), [
    ("layer", lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:])),
    ("rms", lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
])
def test_a_slot_normed_without_weight(states, tmp_path, norm, apply) -> None:
    """An fc_norm-style per-slot norm with no weight on training's side only: slot 1 holds
    Norm(layer 1) in training, layer 1 in serving."""
    record(tmp_path / "training.h5", "training", states,
           [states.layers[0], apply(states.layers[1]), states.layers[3]])
    record(tmp_path / "serving.h5", "serving", states, [states.layers[i] for i in AUX])
    found = diagnoses(tmp_path / "training.h5", tmp_path / "serving.h5")
    assert kinds(found) == ["norm"], [d.message for d in found]
    evidence = found[0].evidence
    assert (evidence.slot, evidence.layer, evidence.normed_side) == (1, 1, "a")
    assert (evidence.norm, evidence.weight) == (norm, "unit")
    assert evidence.slots_a[1] == "norm(target.layer.1)" and evidence.slots_b == TRAINED
    said = {"layer": "LayerNorm", "rms": "RMSNorm"}[norm]
    assert found[0].message.startswith(f"target.aux slot 1: training fed {said}(layer 1)")


def test_a_normed_slot_among_other_layer_changes_is_labelled(states, tmp_path) -> None:
    """Serving feeds [layer 0, layer 2, RMSNorm(layer 3)]: the layer set differs (slot 1) and slot 2
    is normed; both are said, the normed slot by its norm, not as '?'."""
    a = training(tmp_path, states)
    record(tmp_path / "serving.h5", "serving", states, [states.layers[0], states.layers[2], states.final])
    found = diagnoses(a, tmp_path / "serving.h5")
    assert kinds(found) == ["aux_layer_set", "norm"], [d.message for d in found]
    assert "serving fed [layer 0, layer 2, RMSNorm(layer 3)]" in found[0].message
    assert found[0].evidence.slots_b == ["target.layer.0", "target.layer.2", "norm(target.layer.3)"]
    assert (found[1].evidence.slot, found[1].evidence.layer) == (2, 3)


def test_noise_in_a_slot_stays_unknown(states, tmp_path) -> None:
    """A slot holding unrelated values is no norm of any layer, even with a fitted weight."""
    a = training(tmp_path, states)
    noise = torch.from_numpy(np.random.default_rng(0).standard_normal((len(TOKENS), 64)).astype(np.float32))
    record(tmp_path / "serving.h5", "serving", states, [states.layers[0], states.layers[1], noise])
    found = diagnoses(a, tmp_path / "serving.h5")
    assert kinds(found) == ["aux_layer_set"], [d.message for d in found]
    assert found[0].evidence.slots_b == ["target.layer.0", "target.layer.1", None]
    assert "serving fed [layer 0, layer 1, ?]" in found[0].message


def test_a_fitted_weight_needs_enough_rows(states) -> None:
    """On fewer than MIN_ROWS rows a per-channel weight is not fitted: it could explain too much."""
    raw, normed = states.layers[3].double().numpy(), states.final.double().numpy()
    assert norm_fit(raw[: MIN_ROWS - 1], normed[: MIN_ROWS - 1], {}) is None
    fit = norm_fit(raw[:MIN_ROWS], normed[:MIN_ROWS], {})
    assert fit is not None and (fit.norm, fit.weight) == (RMS, FITTED)


def test_a_rounded_copy_is_no_norm(states) -> None:
    """A state whose rows already have unit RMS, rounded to bfloat16, is that state (a precision
    matter), not a unit-weight RMSNorm of it."""
    layer = states.layers[2]
    raw = layer * torch.rsqrt(layer.pow(2).mean(-1, keepdim=True))
    rounded = raw.to(torch.bfloat16).double().numpy()
    assert norm_fit(raw.double().numpy(), rounded, {}) is None


def test_a_slot_normed_differently_on_both_sides(states, tmp_path) -> None:
    """Training applied a unit-weight RMSNorm to layer 3, serving the model's final norm. (The
    whole-row check may add a second `norm`: here the normed slot dominates each row's RMS.)"""
    last = states.layers[3]
    unit = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-6)
    record(tmp_path / "training.h5", "training", states, [states.layers[0], states.layers[1], unit])
    record(tmp_path / "serving.h5", "serving", states, [states.layers[0], states.layers[1], states.final])
    found = [d for d in diagnoses(tmp_path / "training.h5", tmp_path / "serving.h5")
             if isinstance(d.evidence, SlotNormEvidence)]
    assert kinds(found) == ["norm"], [d.message for d in found]
    evidence = found[0].evidence
    assert (evidence.slot, evidence.layer, evidence.normed_side) == (2, 3, "both")
    assert evidence.slots_a[2] == evidence.slots_b[2] == "norm(target.layer.3)"
    assert found[0].message == ("target.aux slot 2: serving fed RMSNorm(layer 3) (fitted weight), "
                                "training fed RMSNorm(layer 3) (unit weight)")
