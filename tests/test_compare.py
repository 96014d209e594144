"""compare on real traces: the committed EAGLE-3 sample and small recorder-made traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO, run_cli
from tracediff.diff.tolerance import Tolerances

SAMPLES = REPO / "traces" / "eagle3"


def compare(*args: str):
    out = run_cli("compare", *args)
    return out, (json.loads(out.stdout) if "--json" in args and out.stdout.strip() else None)


def test_training_vs_healthy_serving_match() -> None:
    out, report = compare(str(SAMPLES / "training.h5"), str(SAMPLES / "serving.h5"), "--json")
    assert out.returncode == 0, out.stderr
    assert report["verdict"] == "match" and report["first_divergence"] is None
    statuses = {t["name"]: t["status"] for t in report["tensors"]}
    assert statuses["draft.fc_in"] == statuses["draft.logits"] == "match"
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows["draft.logits"]["not_comparable"] > 0  # serving's own drafts at depth > 0 differ from truth


def test_the_real_world_aux_bug_is_named() -> None:
    out, report = compare(str(SAMPLES / "training.h5"), str(SAMPLES / "serving_aux_bug.h5"), "--json")
    assert out.returncode == 1
    first = report["first_divergence"]
    assert first["name"] == "target.aux" and first["position"] == 0 and first["depth"] == 0
    assert first["request"] == {"a": "sample0", "b": "req0"}
    (diagnosis,) = report["diagnoses"]
    assert diagnosis["kind"] == "aux_layer_set"
    assert diagnosis["evidence"]["slots_a"] == ["target.embed", "target.layer.1", "target.layer.3"]
    assert diagnosis["evidence"]["slots_b"] == ["target.layer.1", "target.layer.3", "target.layer.5"]
    said = "serving fed [layer 1, layer 3, layer 5], training fed [embed, layer 1, layer 3]"
    assert said in diagnosis["message"]
    statuses = {t["name"]: t["status"] for t in report["tensors"]}
    assert statuses["target.layer.5"] == "match" and statuses["draft.fc_in"] == "downstream"
    assert any(c["key"] == "aux_layer_ids" for c in report["contract"])
    text, _ = compare(str(SAMPLES / "training.h5"), str(SAMPLES / "serving_aux_bug.h5"))
    assert "aux layer set differs: serving fed [layer 1, layer 3, layer 5]" in text.stdout
    md, _ = compare(str(SAMPLES / "training.h5"), str(SAMPLES / "serving_aux_bug.h5"), "--markdown")
    assert md.stdout.startswith("**tracediff compare**") and "| `target.aux` | diverged |" in md.stdout


def write(path, layers: dict, aux_order, tokens, dtype=np.float32, request="r") -> None:
    """A trace of target layers and their concatenation in ``aux_order`` (layer -1 = embed)."""
    with td.record(path) as rec:
        rec.log("target.embed", layers[-1].astype(dtype), token_ids=tokens, request=request)
        for i in sorted(k for k in layers if k >= 0):
            rec.log(f"target.layer.{i}", layers[i].astype(dtype), token_ids=tokens, request=request)
        rec.log("target.aux", np.concatenate([layers[i] for i in aux_order], axis=1).astype(dtype),
                token_ids=tokens, request=request)


@pytest.fixture
def layers():
    rng = np.random.default_rng(0)
    return {i: rng.standard_normal((6, 8)) for i in range(-1, 5)}


@pytest.mark.parametrize(("order_b", "kind"), [((2, 1, 0), "aux_order"), ((1, 2, 3), "layer_offset"),
                                               ((0, 2, 4), "aux_layer_set")])
def test_each_aux_diagnosis(tmp_path, layers, order_b, kind) -> None:
    tokens = np.arange(6) + 10
    write(tmp_path / "a.h5", layers, (0, 1, 2), tokens, request="train")
    write(tmp_path / "b.arrow", layers, order_b, tokens, request="serve-7")
    out, report = compare(str(tmp_path / "a.h5"), str(tmp_path / "b.arrow"), "--json")
    assert out.returncode == 1 and report["first_divergence"]["name"] == "target.aux"
    assert [d["kind"] for d in report["diagnoses"]] == [kind]


def test_bf16_noise_matches_but_a_float32_error_of_1e_3_diverges(tmp_path, layers) -> None:
    torch = pytest.importorskip("torch")
    tokens = np.arange(6)
    write(tmp_path / "f32.h5", layers, (0, 1, 2), tokens)
    with td.record(tmp_path / "bf16.h5") as rec:
        for name, i in (("target.embed", -1), *((f"target.layer.{i}", i) for i in range(5))):
            rec.log(name, torch.from_numpy(layers[i]).to(torch.bfloat16), token_ids=tokens)
    out, report = compare(str(tmp_path / "f32.h5"), str(tmp_path / "bf16.h5"), "--json")
    assert out.returncode == 0 and report["verdict"] == "match", report
    bumped = {k: v.copy() for k, v in layers.items()}
    bumped[2][3, 5] += 1e-3
    write(tmp_path / "bumped.h5", bumped, (0, 1, 2), tokens)
    out, report = compare(str(tmp_path / "f32.h5"), str(tmp_path / "bumped.h5"), "--json")
    assert out.returncode == 1
    first = report["first_divergence"]
    assert first["name"] == "target.layer.2" and first["position"] == 3
    loose, _ = compare(str(tmp_path / "f32.h5"), str(tmp_path / "bumped.h5"), "--tol",
                       "target.*:max_abs<=1e-2")
    assert loose.returncode == 0


def test_different_tokens_compare_only_the_shared_prefix(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    write(tmp_path / "b.h5", layers, (0, 1, 2), np.array([0, 1, 2, 99, 4, 5]))
    out, report = compare(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json")
    assert out.returncode == 0 and report["verdict"] == "match"  # the shared prefix x[0..2] agrees
    assert {t["name"]: t["rows"] for t in report["tensors"]}["target.aux"] == 3
    assert report["token_mismatch"] == {"request_b": "r", "position": 3, "a": 3, "b": 99}


def test_align_by_step_for_same_producer_diffs(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6), request="x")
    changed = {k: v.copy() for k, v in layers.items()}
    changed[1][2] *= 1.01
    write(tmp_path / "b.h5", changed, (0, 1, 2), np.arange(6) + 100, request="y")  # other tokens
    by_prefix, report = compare(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json")
    assert by_prefix.returncode == 2 and report["verdict"] == "incomparable"
    by_step, report = compare(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json", "--align", "step")
    assert by_step.returncode == 1
    first = report["first_divergence"]
    assert first["name"] == "target.layer.1" and first["position"] == 2
    bad, _ = compare(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--align", "tokens")
    assert bad.returncode == 2 and "--align" in bad.stderr


def test_first_nan_is_named(tmp_path, layers) -> None:
    tokens = np.arange(6)
    write(tmp_path / "a.h5", layers, (0, 1, 2), tokens)
    broken = {k: v.copy() for k, v in layers.items()}
    broken[2][4, 1] = np.nan
    broken[3][4:, :] = np.inf  # later, and downstream of the NaN
    write(tmp_path / "b.h5", broken, (0, 1, 2), tokens)
    out, report = compare(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json")
    assert out.returncode == 1 and report["first_divergence"]["name"] == "target.layer.2"
    (nan,) = [d for d in report["diagnoses"] if d["kind"] == "nan_inf"]
    assert nan["evidence"]["tensor"] == "target.layer.2" and nan["evidence"]["side"] == "b"
    assert nan["evidence"]["position"] == 4 and nan["evidence"]["rows_non_finite"] == 1


def test_bad_inputs(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    (tmp_path / "x.h5").write_text("not a trace")
    out, _ = compare(str(tmp_path / "a.h5"), str(tmp_path / "x.h5"))
    assert out.returncode == 2 and out.stderr.strip() == f"error: {tmp_path / 'x.h5'}: not a trace file " \
                                                         "(neither HDF5 nor Arrow IPC)"
    out, _ = compare(str(tmp_path / "a.h5"), str(tmp_path / "a.h5"), "--tol", "target.*:cos=>1")
    assert out.returncode == 2 and "cannot read 'cos=>1'" in out.stderr
    with td.record(tmp_path / "other.h5") as rec:
        rec.log("something.else", np.zeros((2, 3), np.float32), token_ids=np.arange(2))
    out, _ = compare(str(tmp_path / "a.h5"), str(tmp_path / "other.h5"))
    assert out.returncode == 2 and "no rows" in out.stderr


def test_tolerance_grammar() -> None:
    tol = Tolerances.parse(["draft.*:cos>=0.999, max_abs<=1e-2", "target.aux:rel_l2<0.5"])
    expected = {"cosine": (">=", 0.999), "max_abs": ("<=", 0.01)}
    assert tol.bounds("draft.hidden", ("float32", "float32")) == expected
    assert tol.bounds("target.aux", ("float32", "bfloat16")) == {"rel_l2": ("<", 0.5)}
    assert tol.bounds("target.layer.1", ("float32", "bfloat16"))["max_rel"] == ("<=", 3e-2)
    for bad in ("nocolon", "x:cos", "x:speed<1", "x:cos>=__import__('os')"):
        with pytest.raises(ValueError):
            Tolerances.parse([bad])
