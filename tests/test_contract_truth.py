"""What a trace says about itself is true (issue 36): a contract key is written only from what the
producer really did or measured, a reading of the aux ids that cannot apply says so in the trace
(never a silent fallback), keys that restate one fact are derived from it, and compare claims no
draft depths from rows a side never recorded. Every trace here comes from the real producers:
SGLang 0.5.23's model code (serving, the family test bed) and SpecForge 0.2.0's training step
through tracediff's integrations, on CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from testbed.sglang_cpu import sglang_missing

REASON = sglang_missing() or (None if importlib.util.find_spec("specforge") else "specforge is not installed")
if REASON:
    pytest.skip(REASON, allow_module_level=True)

import torch  # noqa: E402

import tracediff as td  # noqa: E402
from testbed import sglang_cpu  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from testbed.sglang_cpu import prepare, serve_sample, train_sample  # noqa: E402
from testbed.sglang_families import family_bed  # noqa: E402
from testbed.specforge_cpu import CpuTrainer, build_draft, collate, hf_sample  # noqa: E402
from tests.conftest import cli, tiny_eagle3, tiny_llama  # noqa: E402
from tracediff.eagle3 import conventions as cv  # noqa: E402
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.eagle3.draft import Eagle3Draft  # noqa: E402
from tracediff.integrations import specforge as sf  # noqa: E402
from tracediff.integrations.sglang import install  # noqa: E402

pytestmark = pytest.mark.slow  # SGLang's and SpecForge's real model code
SERVED = dict(num_steps=3, requests=2, new_tokens=8)  # a few seconds through SGLang's real code
LAYER_READING = ("aux_layer_convention", "aux_embed_slot", "aux_ascending")  # layer numbers -> states
READING = ("aux_sources", "aux_layer_ids_resolved", *LAYER_READING)  # what the states say: one fact


# -- draft depths: never claimed from rows a side did not record ------------------------------------


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return serve_sample(tmp_path_factory.mktemp("healthy"), **SERVED)


@pytest.fixture(scope="module")
def training(healthy, tmp_path_factory):
    return train_sample(tmp_path_factory.mktemp("training"), healthy.texts)  # TTT of 4 depths


def test_a_server_stopped_before_any_draft_row_is_not_said_to_draft_one_token(healthy, training, tmp_path,
                                                                              monkeypatch) -> None:
    """The draft's body is a class whose forward names its batch argument ``batch``: the SGLang
    integration stops at the first draft forward, after the target's rows, and the server goes on.
    Its contract states num_steps 3; its trace holds no draft row, so nothing about the depths it
    drafts can be read from its rows (once: "drafts 1 token per verify (num_steps 3, ...)")."""
    import sglang.srt.models.llama_eagle3 as eagle3

    sglang_cpu.rename_batch_argument(monkeypatch, "draft", eagle3.LlamaModel)
    stopped = serve_sample(tmp_path, **SERVED)
    assert stopped.chains == healthy.chains  # the server went on
    with td.open_trace(stopped.trace) as trace:
        assert trace.speculative_args["num_steps"] == 3
        assert "target.aux" in trace.names() and not [n for n in trace.names() if n.startswith("draft.")
                                                       and n != "draft.d2t"]
    report = td.compare(training, stopped.trace)
    assert report.verdict == "incomplete"
    assert [d for d in report.diagnoses if d.kind == "draft_depths"] == []
    out = cli("compare", str(training), str(stopped.trace))
    assert out.returncode == 3 and "per verify (num_steps" not in out.stdout, out.stdout
    assert "sglang stopped (draft forward" in out.stdout.splitlines()[0]


def test_depths_a_trace_holds_fewer_of_than_its_contract_states_are_said_recorded(healthy, training,
                                                                                  tmp_path) -> None:
    """The healthy server's trace sliced to depth 0 (``slice --depths 0:1``): its contract still
    states num_steps 3, so depths 1-2 were served and not recorded; only depth 3 was never served."""
    sliced = tmp_path / "depth0.h5"
    assert cli("slice", str(healthy.trace), "-o", str(sliced), "--depths", "0:1").returncode == 0
    report = td.compare(training, sliced)
    (said,) = [d for d in report.diagnoses if d.kind == "draft_depths"]
    with td.open_trace(sliced) as trace:
        serving = trace.meta["source"]  # serve_sample names no source: "unknown"
    assert said.message == (f"{serving} recorded draft depth 0 (its contract states num_steps 3, topk 1, "
                            "num_draft_tokens 4); training trained 4 depths (ttt_length 4): depths 1-2 not "
                            f"recorded by {serving}, depth 3 never served, so never compared")
    full = td.compare(training, healthy.trace)  # the whole trace: what it drafts per verify, as before
    (whole,) = [d for d in full.diagnoses if d.kind == "draft_depths"]
    assert whole.message.endswith("drafts 3 tokens per verify (num_steps 3, topk 1, num_draft_tokens 4); "
                                  "training trained 4 depths (ttt_length 4): depth 3 never served, so never "
                                  "compared")


# -- the aux ids: read as the producer read them, or said unread --------------------------------------

DRAFT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, draft_vocab_size=512)


@pytest.fixture(scope="module")
def step():
    """``step(path, **install)``: one real SpecForge training step recorded through the integration
    (a tiny Llama's features: the contract's reading depends on ``install``'s arguments only)."""
    prepare()
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    features = tiny_llama(seed=0, layers=4)
    g = torch.Generator().manual_seed(1)
    batch = collate([hf_sample(features, torch.randint(0, 512, (n,), generator=g),
                               torch.ones(n, dtype=torch.long), (1, 2, 3)) for n in (12, 8)])

    def run(path, **options) -> dict:
        model = OnlineEagle3Model(build_draft(DRAFT, seed=3), length=2)
        with td.record(path, source="training") as rec:
            handle = sf.install(rec, model, **options)
            CpuTrainer(model, features.lm_head.weight.detach()).step(batch)
            handle.remove()
        with td.open_trace(path) as trace:
            return trace.contract

    return run


def test_gpt_oss_ids_ending_at_the_layer_count_are_read_as_its_class_reads_them(step, tmp_path) -> None:
    """gpt-oss ids [1, 3, L]: valid for SpecForge's online capture (the last id is the stream before
    the final norm, what SGLang's class captures after its layer loop). Through SGLang's class the
    contract names layers 0, 2 and L-1; an HF model's hidden_states[i+1] has no state for id L, and no
    layer count lets one; the contract then says the reading does not apply and names no state
    (once: ``target.layer.L`` and "the target's family not given" although the target was given)."""
    bed = family_bed("gpt_oss")
    last = bed.num_layers
    ids = [1, 3, last]
    through = step(tmp_path / "sglang.h5", aux_layer_ids=ids, target=bed.load())
    assert through["aux_layer_reading"] == "specforge 0.2.0 through sglang's GptOssForCausalLM"
    assert through["aux_sources"] == ["target.layer.0", "target.layer.2", f"target.layer.{last - 1}"]
    assert through["aux_layer_ids"] == ids and through["aux_layer_ids_resolved"] == [0, 2, last - 1]
    assert through["target_config"]["architecture"] == "GptOssForCausalLM"
    hf = step(tmp_path / "hf.h5", aux_layer_ids=ids, target=bed.hf)
    assert hf["aux_layer_reading"] == ("output of layer i (HF hidden_states[i+1] of GptOssForCausalLM): "
                                       f"id {last} names no layer's output of the target's {last} layers: "
                                       "not read")
    counted = step(tmp_path / "layers.h5", aux_layer_ids=ids, target_num_layers=last)
    assert counted["aux_layer_reading"].startswith("output of layer i (the target's family not given): id ")
    for contract in (hf, counted):
        assert contract["aux_layer_ids"] == ids and not set(READING) & set(contract)
        assert f"target.layer.{last}" not in json.dumps(contract)
    # SpecForge's online (server-capture) checks take them; its offline capture refuses them
    assert cv.specforge_ids(ids, last, offline=False).ids == tuple(ids)
    assert cv.specforge_ids(ids, last).refusal.startswith("resolved offline capture layers exceed")


def test_a_family_that_feeds_branch_outputs_states_them_and_no_layer_reading(step, tmp_path) -> None:
    """Gemma 3 captures each layer's branch output. SpecForge through its SGLang class trains on
    those (once: the reading fell back to the outputs of layers 1, 2, 3 in silence); SGLang's serving
    contract measures them. Neither states a layer-number reading (aux_layer_convention output_of_layer,
    aux_embed_slot false) that names other states than aux_sources does."""
    bed = family_bed("gemma3_causal")
    branches = [f"target.layer.{i}.branch" for i in (1, 2, 3)]
    stated = {"aux_sources": branches, "aux_layer_ids_resolved": [1, 2, 3], **dict.fromkeys(LAYER_READING)}
    model = bed.load()
    with td.record(tmp_path / "serve.h5", source="serving") as rec:
        installed = install(rec, target=model)
        model.set_eagle3_layers_to_capture([1, 2, 3])
        bed.serve(model)
        installed.remove()
    with td.open_trace(tmp_path / "serve.h5") as trace:
        served = trace.contract
    assert served["aux_slot_states"] == branches and {k: served[k] for k in READING} == stated
    trained = step(tmp_path / "gemma.h5", aux_layer_ids=[1, 2, 3], target=bed.load())
    assert trained["aux_layer_reading"] == "specforge 0.2.0 through sglang's Gemma3ForCausalLM"
    assert {k: trained[k] for k in READING} == stated


# -- compare: a key that restates the states both sides feed alike is no cause -----------------------


def test_aux_ascending_that_changes_no_state_is_no_cause(tmp_path) -> None:
    """Two serving traces of the reference loop hold the aux states of layers 1, 2, 3 in that order,
    one stating aux_ascending false (ids taken in list order), the other true; a rope_theta
    difference diverges. Only rope is a cause; aux_ascending is said to change nothing fed (once: "aux
    settings change the aux states and the fc input, draft.hidden among them"). Where the order does
    change the states (ids [3, 1, 2]), aux_ascending stays a cause."""
    target, draft = tiny_eagle3()
    prompt = [5, 77, 300, 12, 9, 41, 8, 100, 200, 33, 44, 55]
    rope = Eagle3Draft(dataclasses.replace(draft.config, rope_theta=500000.0),
                       embed_tokens=target.model.embed_tokens.weight.detach())
    rope.load_state_dict(draft.state_dict())

    def serve(name: str, spec: AuxSpec, model) -> str:
        decoder = SpeculativeDecoder(target, model.eval(), Conventions(spec), num_steps=3)
        with td.record(tmp_path / name, source="serving", meta=decoder.contract()) as rec:
            decoder.rec = rec
            decoder.decode("r0", prompt, 12)
        return str(tmp_path / name)

    listed = serve("listed.h5", AuxSpec((1, 2, 3)), draft)
    report = td.compare(listed, serve("ascending.h5", AuxSpec((1, 2, 3), ascending=True), rope))
    assert report.verdict == "diverged"
    causes = [d for d in report.diagnoses if d.kind == "config" and d.severity != "info"]
    assert [d.evidence.key for d in causes] == ["draft_config.rope_theta"]
    (bystanders,) = [d for d in report.diagnoses if d.kind == "config" and d.severity == "info"]
    assert "aux_ascending (aux: both sides feed the same states)" in bystanders.message
    out = cli("compare", listed, str(tmp_path / "ascending.h5"))
    assert "  aux_ascending: false | true (aux: both sides read them as the same states [layer 1, layer 2, " \
           "layer 3]: nothing fed differs)" in out.stdout, out.stdout
    reordered = td.compare(serve("312.h5", AuxSpec((3, 1, 2)), draft),
                           serve("312_ascending.h5", AuxSpec((3, 1, 2), ascending=True), draft))
    (aux,) = [d for d in reordered.diagnoses if d.kind == "config" and d.severity != "info"]
    assert aux.evidence.effect == "aux" and "aux_sources" in aux.message
