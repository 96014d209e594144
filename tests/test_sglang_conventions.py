"""conventions.py: what a draft's aux ids select per SGLang target family, from SGLang's own
``set_eagle3_layers_to_capture`` run on a stand-in, and the table that answers without SGLang kept
equal to it for every target class of SGLang's model registry; SpecForge's resolution checked against
SpecForge's own code; docs/INTEGRATIONS.md's family table generated from the table."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tracediff.eagle3 import conventions as cv

CASES = [  # (ids, earlier calls' ids), on 8 layers
    ([1, 2, 3], ()), ([2, 3, 4], ()), (None, ()), ([0, 2, 4], ()), ([1, 3, 8], ()), ([1, 3, 7], ()),
    ([-1, 2, 3], ()), ([-2, 2, 3], ()), ([2, 3, 3], ()), ([2, 3, 4], ([1, 2, 3],)), ([], ()), ([5, 1, 3], ()),
]
LAYERS_1_2_3 = ("target.layer.1", "target.layer.2", "target.layer.3")
AFTER_LOOP = re.compile(r"(num_layers|self\.end_layer|len\(self\.layers\)) in self\.layers_to_capture")


@pytest.fixture(scope="module")
def registry() -> dict[str, type]:
    """Every EAGLE-3 target class of SGLang's own model registry (drafts aside), by architecture."""
    from testbed.sglang_cpu import prepare, sglang_missing

    if sglang_missing():
        pytest.skip(sglang_missing())
    prepare()
    from sglang.srt.models.registry import ModelRegistry

    from tracediff.integrations.sglang.models import model_role

    return {arch: cls for arch, cls in ModelRegistry.models.items() if model_role(cls) == "target"}


@pytest.mark.slow
def test_the_table_names_every_target_class_of_the_registry(registry) -> None:
    from tracediff.integrations.sglang.models import family_of

    table = {arch: family.name for family in cv.FAMILIES.values() for arch in family.classes}
    assert table == {arch: family_of(cls) for arch, cls in registry.items()}
    # every model file that defines the setter is a family here (29 in sglang 0.5.23)
    folder = Path(sys.modules["sglang.srt.models"].__path__[0])
    defining = {p.stem for p in folder.glob("*.py") if f"def {cv.SETTER}" in p.read_text()}
    assert len(defining) == 29 and defining <= set(table.values())


@pytest.mark.slow
def test_the_table_is_what_sglang_resolves(registry) -> None:
    """For every target class and id list: the same layers_to_capture, flags, error and slots."""
    for arch, cls in sorted(registry.items()):
        target = cv.target_for(arch)
        assert target is not None
        if target.capture.rule == cv.DELEGATED:  # MindSpore: the ids go to a model outside SGLang
            assert cv.resolved_selection(cls, [1, 2, 3], 8).error == f"AttributeError: {cv.SETTER}"
            continue
        for ids, earlier in CASES:
            real = cv.resolved_selection(cls, ids, 8, earlier)
            table = cv.table_selection(arch, ids, 8, earlier)
            said = (real.layers_to_capture, real.flags, real.captured, real.states, real.error)
            stated = (table.layers_to_capture, table.flags, table.captured, table.states, table.error)
            assert said == stated, (arch, ids, earlier)
        # flag families are those whose setter sets flags
        assert bool(cv.resolved_selection(cls, [1, 2, 3], 8).flags) == target.capture.flags, arch


@pytest.mark.slow
def test_what_the_forward_reads_is_in_the_source(registry) -> None:
    """after_loop (k = L captured after the layer loop) and packed (a preallocated packer) are read
    off the model files that hold the class and its capturing part."""
    for arch, cls in sorted(registry.items()):
        capture = cv.target_for(arch).capture
        if capture.rule == cv.DELEGATED:
            continue
        body = cv.resolved_selection(cls, [1, 2, 3], 8).body
        classes = [*cls.__mro__, *(body.__mro__ if body else ())]
        text = "".join(inspect.getsource(sys.modules[c.__module__]) for c in dict.fromkeys(classes)
                       if c.__module__.startswith("sglang.srt.models."))
        assert bool(AFTER_LOOP.search(text)) == capture.after_loop, arch
        assert ("AuxHiddenStatePacker(" in text) == capture.packed, arch


@pytest.mark.slow
@pytest.mark.parametrize("arch, ids, layers, expect", [
    # Llama: ids + 1; the loop never reaches layer 6 of 6 (the committed sample draft's [1, 3, 5])
    ("LlamaForCausalLM", [1, 3, 5], 6, dict(ltc=(2, 4, 6), captured=(2, 4), uncaptured=[6])),
    # None on 6 layers: [2, 3, 3], the input of layer 3 named twice and captured once
    ("LlamaForCausalLM", None, 6, dict(ltc=(2, 3, 3), captured=(2, 3), repeated=[3])),
    ("LlamaForCausalLM", [-1, 2, 3], 8, dict(states=("target.embed", "target.layer.2", "target.layer.3"))),
    # DeepSeek-V3 / Kimi: +1 only when the first id is 1
    ("DeepseekV3ForCausalLM", [2, 3, 4], 8, dict(states=LAYERS_1_2_3)),
    ("DeepseekV3ForCausalLM", [1, 2, 3], 8, dict(states=LAYERS_1_2_3)),
    ("DeepseekV3ForCausalLM", [0, 2, 4], 8, dict(states=("target.embed", "target.layer.1",
                                                         "target.layer.3"))),
    ("KimiK25ForConditionalGeneration", [2, 3, 4], 8, dict(ltc=(2, 3, 4))),
    # gpt-oss: kept when the largest id is the layer count; 8 = the last layer's pre-norm output
    ("GptOssForCausalLM", [1, 3, 8], 8, dict(ltc=(1, 3, 8), states=("target.layer.0", "target.layer.2",
                                                                       "target.layer.7"))),
    ("Gemma3ForCausalLM", [1, 2, 3], 8, dict(states=("target.layer.1.branch", "target.layer.2.branch",
                                                     "target.layer.3.branch"))),
    ("Qwen3NextForCausalLM", [1, 3, 7], 8, dict(error="IndexError: list index out of range")),
])
def test_family_facts(registry, arch, ids, layers, expect) -> None:
    for got in (cv.resolved_selection(registry[arch], ids, layers), cv.table_selection(arch, ids, layers)):
        values = {"ltc": got.layers_to_capture, "captured": got.captured, "uncaptured": got.uncaptured,
                  "repeated": got.repeated, "states": got.states, "error": got.error}
        assert {k: values[k] for k in expect} == expect, got.source


@pytest.mark.slow
def test_flags_never_cleared_capture_the_union(registry) -> None:
    got = cv.resolved_selection(registry["Qwen3MoeForCausalLM"], [2, 3, 4], 8, earlier=[[1, 2, 3]])
    assert got.layers_to_capture == (3, 4, 5) and got.captured == (2, 3, 4, 5) and got.stale == [2]


def test_sglang_selection_answers_from_the_table_where_sglang_cannot_import(monkeypatch) -> None:
    monkeypatch.setattr(cv, "_sglang_imports", lambda: False)
    got = cv.sglang_selection("DeepseekV3ForCausalLM", [2, 3, 4], 8)
    assert got.source == "tracediff's table of sglang 0.5.23"
    assert got.states == ("target.layer.1", "target.layer.2", "target.layer.3")


@pytest.mark.slow
def test_specforge_ids_are_specforge_s_own(registry) -> None:
    """specforge_ids against SpecForge 0.2.0's resolver, and what its capture backend hands SGLang."""
    from types import SimpleNamespace

    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    for ids, layers in [(None, 8), (None, 32), ([1, 3, 5], 8), ([-1, 3, 5], 8), ([1, 3], 8),
                        ([2, 3, 4, 5], 8)]:
        cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
        draft = {} if ids is None else {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
        try:
            real = tuple(resolve_eagle_capture_layers(cfg, draft, SimpleNamespace(num_hidden_layers=layers)))
        except ValueError as exc:
            assert cv.specforge_ids(ids, layers).refusal == str(exc)
        else:
            assert cv.specforge_ids(ids, layers).ids == real
    # SpecForge's capture backend hands the ids unchanged to the target's own setter. It imports
    # only next to the sglang it pins (0.5.14: get_pp_group), so its source is read, not run.
    spec = importlib.util.find_spec("specforge")
    source = Path(spec.origin).parent / "offline_capture" / "sglang_backend" / "capture.py"
    method = next(n for n in ast.walk(ast.parse(source.read_text()))
                  if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_capture_layers")
    assert ast.unparse(method.body[-1]) == "self.model_runner.model.set_eagle3_layers_to_capture(layer_ids)"
    # the checks beyond the resolver: distinct ids, below the layer count (offline capture)
    assert str(cv.specforge_ids([2, 2, 3], 8).refusal).startswith("resolved offline capture layers must be "
                                                                   "distinct")
    assert str(cv.specforge_ids([1, 3, 8], 8).refusal).startswith("resolved offline capture layers exceed")
    got = cv.specforge_selection("DeepseekV3ForCausalLM", [2, 3, 4], 8)
    assert got.selection is not None and got.selection.states == cv.sglang_selection(
        "DeepseekV3ForCausalLM", [2, 3, 4], 8).states


def test_integrations_doc_has_the_family_table() -> None:
    doc = (REPO / "docs" / "INTEGRATIONS.md").read_text()
    table = re.search(r"<!-- family-table[^>]*-->\n(.*?)<!-- /family-table -->", doc, re.S)
    assert table is not None and table.group(1).strip() == cv.family_table(), (
        "docs/INTEGRATIONS.md's family table is stale; paste "
        "tracediff.eagle3.conventions.family_table()")
    for family in cv.TESTED_HERE:
        assert f"| {family} | yes" in table.group(1)
    engines = re.search(r"<!-- engine-table[^>]*-->\n(.*?)<!-- /engine-table -->", doc, re.S)
    assert engines is not None and engines.group(1).strip() == cv.engine_table(), (
        "docs/INTEGRATIONS.md's engine table (SGLang, vLLM, SpecForge, HF readers by family) is stale; paste "
        "tracediff.eagle3.conventions.engine_table()")


def test_tested_here_names_exactly_the_families_the_test_bed_runs() -> None:
    """"tested here" in the family table is a claim about tests/test_sglang_families.py: it names the
    test bed's families, no more, no fewer."""
    from testbed.sglang_family_configs import FAMILIES as BED

    assert sorted(cv.TESTED_HERE) == sorted(BED)
