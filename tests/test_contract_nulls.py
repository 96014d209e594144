"""diff/contract_diff.py's reading of null contract keys (issue 36, from an adversarial review): a key
stated as null states nothing (a reading that does not apply, a fact not known), so it is neither a
difference from the other side's value (never a cause, never a different target) nor a key a side
states."""

from __future__ import annotations

import numpy as np

import tracediff as td

TARGET = {"architecture": "LlamaForCausalLM", "hidden_size": 8, "num_hidden_layers": 4, "vocab_size": 1000}
SOURCES = ["target.layer.1", "target.layer.2", "target.layer.3"]


def write(path, **contract) -> None:
    tokens = np.arange(6)
    with td.record(path, meta=contract) as rec:
        rec.log("target.aux", np.random.default_rng(0).standard_normal((6, 24)).astype(np.float32),
                token_ids=tokens, request="r")


def test_a_null_fact_is_no_other_target_and_a_null_reading_no_cause(tmp_path) -> None:
    write(tmp_path / "a.h5", target_config=TARGET, aux_sources=SOURCES, aux_layer_ids=[0, 1, 2])
    write(tmp_path / "b.h5", target_config=None, aux_sources=None, aux_layer_ids=None, aux_ascending=None)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "match", report.reasons
    assert report.contract.differing == [] and report.contract.only_b == {}
    assert set(report.contract.only_a) == {"target_config", "aux_sources", "aux_layer_ids"}
