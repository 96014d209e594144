"""Config differences named as causes: contracts compared key by key, the config-cause table (which
keys can change which canonical tensors), and the ``config`` diagnosis on real traces of the
reference serving loop (a tiny Llama target and EAGLE-3 draft) whose draft config differs in one
key, so that the error profile is the one that key really leaves."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from tests.conftest import tiny_eagle3  # noqa: E402
from tracediff.diff.contract_diff import cause_of, causes_table  # noqa: E402
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.eagle3.draft import Eagle3Draft  # noqa: E402

SPEC = AuxSpec((1, 2, 3))
PROMPT = [5, 77, 300, 12, 9, 41, 8, 100, 200, 33, 44, 55]
HARMLESS = tuple({"attention_backend": backend, "server_args": {"disable_overlap_schedule": off}}
                 for backend, off in (("sdpa", False), ("torch_native", True)))


@pytest.fixture(scope="module")
def models():
    return tiny_eagle3()


def variant(models, **changes):
    """The healthy draft's weights under a draft config with ``changes``."""
    target, draft = models
    changed = Eagle3Draft(dataclasses.replace(draft.config, **changes),
                          embed_tokens=target.model.embed_tokens.weight.detach())
    changed.load_state_dict(draft.state_dict())
    return changed.eval()


def serve(models, path: Path, draft=None, extra: dict | None = None, stated: dict | None = None) -> Path:
    """A serving trace of the reference loop; ``extra``: more contract keys; ``stated``: draft
    config keys the contract states other than the draft uses."""
    target, healthy = models
    decoder = SpeculativeDecoder(target, draft or healthy, Conventions(SPEC), num_steps=3)
    contract = decoder.contract()
    contract["draft_config"] = {**contract["draft_config"], **(stated or {})}
    with td.record(path, source="serving", meta={**contract, **(extra or {})}) as rec:
        decoder.rec = rec
        decoder.decode("r0", PROMPT, 20)
    return path


@pytest.fixture(scope="module")
def healthy(models, tmp_path_factory) -> Path:
    return serve(models, tmp_path_factory.mktemp("healthy") / "a.h5", extra=HARMLESS[0])


def config_diagnoses(report) -> list:
    return [d for d in report.diagnoses if d.kind == "config"]


def terminal(report) -> str:
    from rich.console import Console

    from tracediff.report.compare import render

    out = io.StringIO()
    render(Console(file=out, width=400), report)
    return out.getvalue()


@pytest.mark.slow
def test_a_rope_theta_difference_is_named_with_its_profile_and_the_harmless_keys_after(models, healthy,
                                                                                    tmp_path) -> None:
    b = serve(models, tmp_path / "b.h5", variant(models, rope_theta=500000.0), extra=HARMLESS[1])
    report = td.compare(healthy, b)
    assert report.verdict == "diverged"
    first = report.first_divergence
    assert (first.name, first.row.position, first.row.depth) == ("draft.hidden", 1, 0)
    assert {e.key: (e.a, e.b) for e in report.contract.differing} == {
        "attention_backend": ("sdpa", "torch_native"),
        "draft_config.rope_theta": (10000.0, 500000.0),
        "server_args.disable_overlap_schedule": (False, True)}
    cause, bystanders = config_diagnoses(report)
    assert cause.severity == "error" and report.diagnoses.index(cause) < report.diagnoses.index(bystanders)
    ev = cause.evidence
    assert (ev.key, ev.value_a, ev.value_b) == ("draft_config.rope_theta", 10000.0, 500000.0)
    assert ev.effect == "rope"
    assert (ev.profile, ev.profile_fits) == ("grows_with_position", True)
    assert bystanders.severity == "info"
    assert bystanders.evidence.cannot_explain == ["attention_backend", "server_args.disable_overlap_schedule"]
    text = terminal(report)
    assert "no known explanation" not in text
    assert "  draft_config.rope_theta: 10000.0 | 500000.0 (rope: " in text
    assert "  attention_backend: \"sdpa\" | \"torch_native\" (none: changes no tensor by itself)" in text
    assert text.index("draft_config.rope_theta: 10000.0") < text.index("attention_backend: \"sdpa\"")
    assert "rms_norm_eps" not in text  # the whole draft_config is never printed
    plain = json.loads(report.to_json())
    assert [d["evidence"]["key"] for d in plain["diagnoses"] if "key" in d["evidence"]] == \
        ["draft_config.rope_theta"]


@pytest.mark.slow
def test_an_rms_norm_eps_difference_is_named_from_position_0(models, healthy, tmp_path) -> None:
    b = serve(models, tmp_path / "b.h5", variant(models, rms_norm_eps=1e-5), extra=HARMLESS[0])
    report = td.compare(healthy, b)
    first = report.first_divergence
    assert (report.verdict, first.name, first.row.position) == ("diverged", "draft.hidden", 0)
    [cause] = config_diagnoses(report)
    ev = cause.evidence
    assert (ev.key, ev.value_a, ev.value_b, ev.effect) == ("draft_config.rms_norm_eps", 1e-6, 1e-5, "norm")
    assert (ev.profile, ev.profile_fits, cause.severity) == ("from_position_0", True, "error")


@pytest.mark.slow
def test_the_profile_ranks_two_stated_differences(models, healthy, tmp_path) -> None:
    """The draft really runs another rope_theta; its contract also states another rms_norm_eps it
    does not use. Both keys can change draft.hidden; the error profile (row 0 untouched, growing)
    puts rope first, and the eps key after it as a warning that the profile does not fit."""
    b = serve(models, tmp_path / "b.h5", variant(models, rope_theta=500000.0), extra=HARMLESS[0],
              stated={"rms_norm_eps": 1e-5})
    report = td.compare(healthy, b)
    rope, eps = config_diagnoses(report)
    assert (rope.evidence.key, rope.severity, rope.evidence.profile_fits) == \
        ("draft_config.rope_theta", "error", True)
    assert (eps.evidence.key, eps.severity, eps.evidence.profile_fits) == \
        ("draft_config.rms_norm_eps", "warning", False)


@pytest.mark.slow
def test_a_divergence_no_differing_key_can_change_gets_no_config_cause(models, healthy, tmp_path) -> None:
    """A serving draft whose fc weight differs: draft.fc_out diverges; a rope_theta the contract
    states differently cannot change fc_out, so no config key is named for it."""
    draft = variant(models)
    with torch.no_grad():
        draft.fc.weight.mul_(1.5)
    b = serve(models, tmp_path / "b.h5", draft, extra=HARMLESS[0], stated={"rope_theta": 500000.0})
    report = td.compare(healthy, b)
    assert report.first_divergence.name == "draft.fc_out"
    assert config_diagnoses(report) == []


@pytest.mark.parametrize(("key", "changes", "unchanged"), [
    ("draft_config.rope_theta", ["draft.hidden", "draft.token"], ["draft.fc_out", "target.layer.1"]),
    ("draft_config.rope_scaling.factor", ["draft.hidden"], ["draft.fc_in"]),
    ("draft_config.max_position_embeddings", ["draft.hidden"], ["draft.embed"]),
    ("draft_config.rms_norm_eps", ["draft.fc_out", "draft.hidden", "draft.logits"], ["draft.fc_in"]),
    ("draft_config.norm_before_fc", ["draft.fc_out"], ["draft.fc_in"]),
    ("draft_config.draft_vocab_size", ["draft.logits", "draft.token", "draft.d2t"], ["draft.hidden"]),
    ("d2t_sha256", ["draft.token_target", "draft.t2d"], ["draft.hidden", "target.aux"]),
    ("aux_layer_ids", ["target.aux", "draft.fc_in", "draft.hidden"], ["target.layer.2", "draft.embed"]),
    ("draft_config.target_hidden_size", ["draft.fc_in"], ["target.layer.0"]),
    ("attention_backend", [], ["draft.hidden", "target.aux", "target.logits"]),
    ("server_args.disable_overlap_schedule", [], ["draft.hidden"]),
    ("server_args.disable_cuda_graph", [], ["draft.hidden"]),
    ("log_level", [], ["draft.hidden"]),
])
def test_the_cause_table_says_which_tensors_a_key_can_change(key, changes, unchanged) -> None:
    cause = cause_of(key)
    assert all(cause.changes(key, t) for t in changes) and not any(cause.changes(key, t) for t in unchanged)


def test_dtypes_change_precision_only() -> None:
    assert cause_of("dtypes.target").effect == cause_of("server_args.dtype").effect == "precision"


def test_the_report_doc_holds_the_cause_table() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "REPORT.md").read_text()
    assert causes_table() in doc


def test_the_contract_is_a_fact_of_the_trace_computed_once(tmp_path) -> None:
    import numpy as np

    path = tmp_path / "t.h5"
    with td.record(path, meta={"aux_layer_ids": [1, 2]}) as rec:
        rec.update_contract(row_keys="tokens")
        rec.log("h", np.ones((2, 4), np.float32), token_ids=[1, 2])
    with td.open_trace(path) as trace:
        stated = trace.contract
        assert stated == {"aux_layer_ids": [1, 2], "row_keys": "tokens"} and trace.contract is stated


@pytest.mark.parametrize("sources_b, said", [
    (["target.layer.1", "target.layer.2", "target.layer.3"],
     "aux: both sides read them as the same states [layer 1, layer 2, layer 3]: nothing fed differs"),
    (["target.layer.2", "target.layer.3", "target.layer.4"], "aux: changes the aux states and the fc input"),
])
def test_aux_ids_that_resolve_to_the_same_states_change_nothing_fed(tmp_path, sources_b, said) -> None:
    """DeepSeek-V3 reads ids [1, 2, 3] and [2, 3, 4] as the same layers: the ids differ, what the
    draft is fed does not, and the report says so; where the states differ too, the ids are a cause."""
    from tracediff.diff.contract_diff import contract_diff, describe_entry
    from tracediff.diff.pair import Pair

    paths = []
    for name, ids, sources in (("a", [1, 2, 3], ["target.layer.1", "target.layer.2", "target.layer.3"]),
                               ("b", [2, 3, 4], sources_b)):
        with td.record(tmp_path / f"{name}.h5", source="serving",
                       meta={"aux_layer_ids": ids, "aux_sources": sources}) as rec:
            rec.log("target.aux", torch.zeros(2, 6), token_ids=[5, 6])
        paths.append(tmp_path / f"{name}.h5")
    with td.open_trace(paths[0]) as a, td.open_trace(paths[1]) as b:
        diff = contract_diff(Pair(a, b))
    [entry] = [e for e in diff.differing if e.key == "aux_layer_ids"]
    assert describe_entry(entry, diff) == said
    report = td.compare(*paths)
    assert ("aux_sources" in report.contract.agreeing) == (sources_b == ["target.layer.1", "target.layer.2",
                                                                          "target.layer.3"])
