"""The SGLang launcher plugin's choices, in-process: which classes it records as what, and that a
target missing an internal costs one warning naming the class and the internal, never the server."""

from __future__ import annotations

import logging

import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import torch  # noqa: E402

import tracediff as td  # noqa: E402
from testbed.sglang_families import family_bed  # noqa: E402
from tests.conftest import run_python  # noqa: E402
from tracediff.integrations.sglang import install  # noqa: E402
from tracediff.integrations.sglang.models import model_role, target_layout  # noqa: E402
from tracediff.integrations.sglang.plugin import _Plugin  # noqa: E402
from tracediff.record.plugin import LaunchConfig  # noqa: E402

pytestmark = pytest.mark.slow  # SGLang's real model code (its import and CPU set-up alone take ~10 s)


def test_every_eagle3_class_has_its_role():
    """Targets are the classes that capture aux states for EAGLE-3 (VL wrappers included), drafts
    the EAGLE-3 classes (which subclass targets), anything else is left alone."""
    family_bed("llama")  # SGLang's CPU recipe, before its model files import
    from sglang.srt.models import deepseek_v2, gemma3_causal, llama, llama_eagle3, qwen3_moe

    assert model_role(llama.LlamaForCausalLM) == "target"
    assert model_role(deepseek_v2.DeepseekV3ForCausalLM) == "target"
    assert model_role(qwen3_moe.Qwen3MoeForCausalLM) == "target"
    assert model_role(gemma3_causal.Gemma3ForCausalLM) == "target"
    assert model_role(llama_eagle3.LlamaForCausalLMEagle3) == "draft"
    assert model_role(torch.nn.Linear) is None
    from sglang.srt.models import deepseek_nextn, llama_eagle  # drafts of other algorithms inherit the setter

    assert callable(getattr(llama_eagle.LlamaForCausalLMEagle, "set_eagle3_layers_to_capture", None))
    assert model_role(llama_eagle.LlamaForCausalLMEagle) is None
    assert model_role(deepseek_nextn.DeepseekV3ForCausalLMNextN) is None


def test_a_missing_internal_is_one_warning_naming_class_and_internal(tmp_path, caplog):
    """A target whose text body lost an internal the recording reads is not recorded: the plugin
    warns once, naming the class and the internal; the model serves as if nothing were attached."""
    bed = family_bed("qwen3")
    model = bed.load()
    model.set_eagle3_layers_to_capture([1, 2, 3])
    expected = bed.serve(model).tokens
    del model.model.norm  # an SGLang whose text model keeps its final norm elsewhere
    config = LaunchConfig(out=str(tmp_path / "serve.h5"), plugins=())
    opened = []

    def factory(rank=None, world_size=None, **options):
        opened.append(td.record(tmp_path / "serve.h5", **options))
        return opened[-1]

    plugin = _Plugin(config, factory)
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        plugin.attach(model)
        plugin.attach(model)  # the same model again (a subclass's and its base's loader): no second try
    warnings = [r.getMessage() for r in caplog.records if r.name == "tracediff"]
    assert len(warnings) == 1, warnings
    assert "Qwen3ForCausalLM" in warnings[0] and "Qwen3Model.norm" in warnings[0]
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    model.model.norm = bed.load().model.norm  # put it back: the model serves as before
    assert bed.serve(model).tokens == expected
    for rec in opened:
        rec.close()


def test_layout_names_where_each_family_keeps_its_parts():
    """The text body is the module owning layers_to_capture; the layer pattern says where the
    residual stream is read (boundary layers: at the attention boundary; classic: branch + residual)."""
    for family, pattern in (("llama", "boundary"), ("deepseek_v2", "boundary"), ("gemma3_causal", "classic")):
        layout = target_layout(family_bed(family).load())
        assert layout.pattern == pattern and layout.family == family
        assert layout.body is layout.model.model
        assert len(layout.layers) == layout.contract()["target_num_layers"]


def test_the_contract_states_what_was_captured_not_what_was_asked(tmp_path):
    """Ids [1, 3, 5] on a 6-layer Llama: SGLang sets layers_to_capture [2, 4, 6], but its layer loop
    never reaches boundary 6, so the aux holds two slots; after the first forward the contract
    says so (the draft's fc, built for three, is what fails next)."""
    bed = family_bed("llama")
    model = bed.load()
    with td.record(tmp_path / "serve.h5", source="serving") as rec:
        install(rec, target=model)
        model.set_eagle3_layers_to_capture([1, 3, 5])
        bed.serve(model)
    with td.open_trace(tmp_path / "serve.h5") as trace:
        stated = trace.contract
        assert stated["layers_to_capture"] == [2, 4, 6] and stated["aux_layer_ids"] == [1, 3, 5]
        assert stated["aux_capture_layers"] == [2, 4]
        assert stated["aux_sources"] == stated["aux_slot_states"] == ["target.layer.1", "target.layer.3"]
        assert trace.rows("target.aux").data.shape[1] == 2 * trace.rows("target.layer.0").data.shape[1]


def test_a_forward_that_raises_leaves_no_capture_claimed(tmp_path):
    """DeepSeek-V3 packs one slot per layers_to_capture entry: ids [1, 2, 5] on 6 layers ask for
    boundary 6, which its loop never reaches, and the forward raises. The contract then says what
    the setter set, and nothing about what the aux held: no forward measured it."""
    bed = family_bed("deepseek_v2")
    model = bed.load()
    with td.record(tmp_path / "serve.h5", source="serving") as rec:
        install(rec, target=model)
        model.set_eagle3_layers_to_capture([1, 2, 5])
        with pytest.raises(RuntimeError, match="captured 2 of 3 aux hidden states"):
            bed.serve(model)
    with td.open_trace(tmp_path / "serve.h5") as trace:
        stated = trace.contract
    assert stated["layers_to_capture"] == [2, 3, 6] and stated["aux_capture_set"] == [2, 3, 6]
    assert stated["aux_layer_ids"] == [1, 2, 5]
    assert all(stated[key] is None for key in ("aux_slot_states", "aux_capture_layers", "aux_sources",
                                               "aux_layer_ids_resolved"))


def test_a_subclass_of_your_own_keeps_its_family():
    model = family_bed("qwen3").load()
    model.__class__ = type("MyQwen3", (type(model),), {})
    layout = target_layout(model)
    assert layout.family == "qwen3" and layout.model_class.endswith("MyQwen3")


@pytest.mark.subprocess
def test_sglang_that_cannot_import_is_one_error_naming_why():
    """On a CPU machine without triton, SGLang itself cannot be imported: install says so in one
    line (SglangInternalsError), the first time and every time after."""
    done = run_python(
        "import importlib.util, tracediff as td, torch\n"
        "print(importlib.util.find_spec('triton') is None)\n"
        "from tracediff.integrations.sglang import install, SglangInternalsError\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        install(td.record('x.h5', enabled=False), target=torch.nn.Linear(2, 2))\n"
        "    except SglangInternalsError as exc:\n"
        "        print(exc)\n")
    no_triton, *lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stderr[-2000:]
    if no_triton == "True":  # this machine and CI: SGLang needs the CPU recipe
        assert all("cannot be imported in this process" in line for line in lines)
        assert "No module named 'triton'" in lines[0]
    else:  # SGLang imports: the stand-in is refused for what it lacks
        assert all("has no set_eagle3_layers_to_capture" in line for line in lines)
