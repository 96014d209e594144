"""Recording every SGLang EAGLE-3 target family the CPU test bed runs: llama, qwen2/3, the Qwen and
GLM MoEs, DeepSeek-V3 (MLA), GPT-OSS, MiniMax-M2, Gemma 3 and Apertus, on SGLang's real model code.

``install(rec, target=model)`` on each, ids set through ``set_eagle3_layers_to_capture`` as the
server sets them, a prefill and a decode: ``target.layer.{i}`` is HF's output of layer i (the last
one before the final norm), ``target.aux`` slot by slot what that family really feeds the draft
(each family's id convention and capture quirks), and the contract names the class, the family and
the states the aux holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import tracediff as td  # noqa: E402
from testbed.sglang_families import PROMPT, FamilyBed, Reference, family_bed  # noqa: E402
from testbed.sglang_family_configs import FAMILIES, HIDDEN, LAYERS  # noqa: E402
from tracediff.integrations.sglang import install  # noqa: E402

pytestmark = pytest.mark.slow

ROWS = len(PROMPT) + 1  # the prefill's rows, then the decode's
RESIDUAL_PLUS_ONE = ("llama", "qwen2", "qwen3", "glm4_moe", "minimax_m2", "apertus", "gpt_oss")
FIRST_ID_IS_ONE = ("deepseek_v2", "kimi_k25", "glm4_moe_lite")  # +1 only when the first id is 1
PACKED = ("deepseek_v2", "kimi_k25")  # one slot per layers_to_capture entry, preallocated (Kimi-K2.5: its
# VL wrapper hands the ids unchanged to its DeepseekV3ForCausalLM)
FLAGS = ("qwen2_moe", "qwen3_moe")  # capture by per-layer flags that are never cleared
BRANCH = ("gemma3_causal",)  # captures the previous layer's branch output, not the residual stream


@dataclass(frozen=True)
class State:
    """A target state an aux slot can hold: HF's embedding output, the output of layer i (the
    residual stream), or layer i's branch (what its last residual add takes)."""

    kind: str  # "embed", "layer" or "branch"
    layer: int = -1

    @property
    def name(self) -> str:
        """The trace's name of this state (a branch output: ``target.layer.{i}.branch``)."""
        if self.kind == "embed":
            return "target.embed"
        return f"target.layer.{self.layer}" + (".branch" if self.kind == "branch" else "")

    def of(self, ref: Reference) -> np.ndarray:
        if self.kind == "embed":
            return ref.hidden_states[0].numpy()
        if self.kind == "branch":
            return ref.branch[self.layer].numpy()
        return (ref.pre_norm if self.layer == LAYERS - 1 else ref.hidden_states[self.layer + 1]).numpy()


def layers(*ids: int) -> list[State]:
    return [State("layer", i) for i in ids]


def branches(*ids: int) -> list[State]:
    return [State("branch", i) for i in ids]


# What each family feeds the draft for a sequence of set_eagle3_layers_to_capture calls on one
# model (SGLang 0.5.23, 6 layers), per the probe of issue 18: the spec these tests hold it to.
FIRST = [[1, 2, 3]]
SECOND = [[1, 2, 3], [2, 3, 4]]  # a second call on the same model
Case = tuple[list[list[int] | None], list[State]]  # the calls, and the states the aux then holds


def fed(name: str) -> dict[str, Case]:
    cases: dict[str, Case] = {"first": (FIRST, branches(1, 2, 3) if name in BRANCH else layers(1, 2, 3))}
    if name in BRANCH:
        cases["second"] = SECOND, branches(2, 3, 4)
    elif name in FIRST_ID_IS_ONE:
        cases["second"] = SECOND, layers(1, 2, 3)  # [2, 3, 4] captures the inputs of layers 2, 3, 4
        cases["embed"] = [[0, 2, 4]], [State("embed"), *layers(1, 3)]  # layer 0's input: the embedding
    elif name in FLAGS:
        cases["second"] = SECOND, layers(1, 2, 3, 4)  # the union: 4 slots
    else:
        assert name in RESIDUAL_PLUS_ONE, f"{name}: no id convention stated"
        cases["second"] = SECOND, layers(2, 3, 4)
    if name == "gpt_oss":
        cases["final"] = [[1, 3, LAYERS]], layers(0, 2, LAYERS - 1)  # no +1 when max(ids) == L
    if name in BRANCH:  # id L-1 is captured after the layer loop: the last layer's branch output too
        cases["final"] = [[1, 2, LAYERS - 1]], branches(1, 2, LAYERS - 1)
    # no ids: [2, L//2, L-3] everywhere, [2, 3, 3] for 6 layers: the same boundary twice, captured once
    # (DeepSeek packs 3 slots and stops: test_deepseek_duplicate_ids_stop_the_forward)
    if name not in PACKED:
        cases["default"] = [None], branches(1, 2) if name in BRANCH else layers(1, 2)
    return cases


FED = {name: fed(name) for name in FAMILIES}
CASES = [(name, case) for name in FAMILIES for case in FED[name]]


@dataclass
class Recorded:
    bed: FamilyBed
    model: object
    trace: td.Trace
    ref: Reference


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """``record(name, calls)``: a fresh SGLang target of that family, recorded (once per module for
    the same arguments); ``calls`` are the id lists handed to ``set_eagle3_layers_to_capture`` in
    order, as the server hands them."""
    done: dict[tuple, Recorded] = {}

    def run(name: str, calls: list[list[int] | None]) -> Recorded:
        key = (name, *(None if ids is None else tuple(ids) for ids in calls))
        if key not in done:
            bed = family_bed(name)
            model = bed.load()
            path = tmp_path_factory.mktemp(name) / "serve.h5"
            with td.record(path, source="serving") as rec:
                installed = install(rec, target=model)
                for ids in calls:
                    model.set_eagle3_layers_to_capture(ids)
                served = bed.serve(model)
                installed.remove()
            done[key] = Recorded(bed, model, td.open_trace(path), bed.reference(served.tokens))
        return done[key]

    yield run
    for recorded in done.values():
        recorded.trace.close()


def rows(trace: td.Trace, name: str) -> np.ndarray:
    """``name``'s rows by position: the prompt's (prefill), then the decoded token's."""
    assert name in trace.names(), f"{name} not recorded (recorded: {trace.names()})"
    got = trace.rows(name)
    order = np.argsort(got.position, kind="stable")
    assert got.position[order].tolist() == list(range(ROWS)), name
    return got.numpy()[order]


def assert_state(got: np.ndarray, want: np.ndarray, tolerance: float, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * float(np.abs(want).max()), err_msg=what)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layers_are_hf_layer_outputs(record, name):
    """target.embed == HF hidden_states[0], target.layer.i == hidden_states[i+1] (the output of layer
    i), the last layer's before the final norm (HF's last hidden state is after it: that one is
    target.final_hidden), at every prefill and decode row."""
    run = record(name, FIRST)
    tolerance = run.bed.family.tolerance
    assert_state(rows(run.trace, "target.embed"), State("embed").of(run.ref), tolerance, "target.embed")
    for i in range(LAYERS):
        state = State("layer", i)
        assert_state(rows(run.trace, state.name), state.of(run.ref), tolerance, state.name)
    assert_state(rows(run.trace, "target.final_hidden"), run.ref.hidden_states[-1].numpy(), tolerance,
                 "target.final_hidden")


@pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_aux_is_what_the_family_feeds_the_draft(record, name, case):
    """target.aux, slot by slot, == the states this family really captures for these ids (HF's on the
    same tokens), and the contract's aux_slot_states / aux_sources name them."""
    calls, fed = FED[name][case]
    run = record(name, calls)
    aux = rows(run.trace, "target.aux")
    assert aux.shape[1] == len(fed) * HIDDEN, f"{aux.shape[1] // HIDDEN} slots, {len(fed)} fed"
    for k, (slot, state) in enumerate(zip(np.split(aux, len(fed), axis=1), fed)):
        assert_state(slot, state.of(run.ref), run.bed.family.tolerance, f"slot {k}: {state}")
    contract = run.trace.contract
    assert contract["aux_slot_states"] == [s.name for s in fed]
    assert len(contract["aux_capture_layers"]) == len(fed), contract["aux_capture_layers"]
    if name not in BRANCH:  # the layer set as resolved names the same residual-stream states
        assert contract["aux_sources"] == [s.name for s in fed]
    for k, (slot, state) in enumerate(zip(np.split(aux, len(fed), axis=1), fed)):
        if state.name in run.trace.names():  # the state recorded under that name is the slot's
            np.testing.assert_array_equal(slot, rows(run.trace, state.name), err_msg=f"slot {k}")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_contract_names_class_and_family(record, name):
    """The contract names the target's model class and its SGLang family (its model file)."""
    run = record(name, FIRST)
    contract = run.trace.contract
    assert contract["target_model_class"].split(".")[-1] == type(run.model).__name__
    assert contract["target_family"] == name
    assert contract["target_num_layers"] == LAYERS


def test_deepseek_duplicate_ids_stop_the_forward(tmp_path):
    """DeepSeek-V2/V3 pack the aux into a buffer of one slot per layers_to_capture entry: ids naming
    one boundary twice (no ids, 6 layers: [2, 3, 3]) capture it once, and the forward raises."""
    bed = family_bed("deepseek_v2")
    model = bed.load()
    with td.record(tmp_path / "serve.h5", source="serving") as rec:
        installed = install(rec, target=model)
        model.set_eagle3_layers_to_capture(None)
        with pytest.raises(RuntimeError, match="captured 2 of 3 aux hidden states"):
            bed.serve(model)
        installed.remove()
    with td.open_trace(tmp_path / "serve.h5") as trace:
        assert trace.contract["layers_to_capture"] == [2, 3, 3]
        assert trace.contract["aux_capture_set"] == [2, 3]  # what the setter set, each boundary once
        assert trace.contract["aux_capture_layers"] is None  # no forward handed an aux on to measure
