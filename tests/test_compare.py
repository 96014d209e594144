"""compare on real traces: the committed EAGLE-3 sample and small recorder-made traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO, cli
from tracediff.diff.results import Report
from tracediff.diff.tolerance import Tolerances

SAMPLES = REPO / "traces" / "eagle3"


def command(*args: str):
    """The command, for what only the command does: exit codes, text, errors."""
    out = cli("compare", *args)
    return out, (json.loads(out.stdout) if "--json" in args and out.stdout.strip() else None)


def statuses(report: Report) -> dict[str, str]:
    return {t.name: t.status for t in report.tensors}


def test_training_vs_healthy_serving_match() -> None:
    report = td.compare(SAMPLES / "training.h5", SAMPLES / "serving.h5")
    assert report.verdict == "match" and report.first_divergence is None and report.exit_code == 0
    assert statuses(report)["draft.fc_in"] == statuses(report)["draft.logits"] == "match"
    logits = next(t for t in report.tensors if t.name == "draft.logits").coverage
    assert logits.skipped_b["fed_differs"] > 0  # serving's own drafts at depth > 0 differ from truth
    assert logits.fraction == 1.0 and report.coverage.fraction == 1.0
    # keys only one side states are not differences
    assert report.contract.differing == [] and "target_model" in report.contract.only_a


def test_the_real_world_aux_bug_is_named() -> None:
    out, report = command(str(SAMPLES / "training.h5"), str(SAMPLES / "serving_aux_bug.h5"), "--json")
    assert out.returncode == 1
    first = report["first_divergence"]
    assert first["name"] == "target.aux" and first["row"]["position"] == 0 and first["row"]["depth"] == 0
    assert (first["row"]["request_a"], first["row"]["request_b"]) == ("sample0", "req0")
    diagnosis, stated = report["diagnoses"]  # the slots found, then the contract keys that differ
    assert "(differing too: aux_sources)" in stated["message"]  # one setting, stated two ways
    assert (diagnosis["kind"], stated["kind"], stated["evidence"]["key"]) == ("aux_layer_set", "config",
                                                                             "aux_layer_ids")
    assert diagnosis["evidence"]["slots_a"] == ["target.embed", "target.layer.1", "target.layer.3"]
    assert diagnosis["evidence"]["slots_b"] == ["target.layer.1", "target.layer.3", "target.layer.5"]
    said = "serving fed [layer 1, layer 3, layer 5], training fed [embed, layer 1, layer 3]"
    assert said in diagnosis["message"]
    by_name = {t["name"]: t["status"] for t in report["tensors"]}
    assert by_name["target.layer.5"] == "match" and by_name["draft.fc_in"] == "downstream"
    assert any(c["key"] == "aux_layer_ids" for c in report["contract"]["differing"])
    text, _ = command(str(SAMPLES / "training.h5"), str(SAMPLES / "serving_aux_bug.h5"))
    first_line = text.stdout.splitlines()[0]
    assert first_line.startswith("diverged (1263 rows compared, coverage 100%; depth 0: 1254 rows, 1: 7, "
                                 "2-3: none comparable): first diverging tensor target.aux")
    assert "aux layer set differs: serving fed [layer 1, layer 3, layer 5]" in text.stdout
    md, _ = command(str(SAMPLES / "training.h5"), str(SAMPLES / "serving_aux_bug.h5"), "--markdown")
    assert md.stdout.startswith("**tracediff compare**") and "| `target.aux` | diverged |" in md.stdout
    for part in ("Compared: 1263 of 3146 rows in a, 1263 of 2432 in b", "differs: `aux_layer_ids`",
                 "only a states `target_model`", "not comparable at depth > 0", "tracediff 0.1.0"):
        assert part in md.stdout, part


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


def test_bf16_noise_matches_but_a_float32_error_of_1e_3_diverges(tmp_path, layers) -> None:
    torch = pytest.importorskip("torch")
    tokens = np.arange(6)
    write(tmp_path / "f32.h5", layers, (0, 1, 2), tokens)
    with td.record(tmp_path / "bf16.h5") as rec:
        for name, i in (("target.embed", -1), *((f"target.layer.{i}", i) for i in range(5))):
            rec.log(name, torch.from_numpy(layers[i]).to(torch.bfloat16), token_ids=tokens)
    report = td.compare(tmp_path / "f32.h5", tmp_path / "bf16.h5")
    assert report.verdict == "match", report.reasons
    bumped = {k: v.copy() for k, v in layers.items()}
    bumped[2][3, 5] += 1e-3
    write(tmp_path / "bumped.h5", bumped, (0, 1, 2), tokens)
    report = td.compare(tmp_path / "f32.h5", tmp_path / "bumped.h5")
    assert report.verdict == "diverged" and first_key(report) == ("target.layer.2", 3, 0)
    loose = td.compare(tmp_path / "f32.h5", tmp_path / "bumped.h5", tol=["target.*:max_abs<=1e-2"])
    assert loose.verdict == "match"


def test_text_both_sides_recorded_that_differs_is_a_divergence_of_the_tokens(tmp_path, layers) -> None:
    """Issue 36: one text, one token replaced (another chat template, a typo): the two sides were fed
    other text, which is the finding, not a partial trace: diverged at the tokens, whatever coverage."""
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    write(tmp_path / "b.h5", layers, (0, 1, 2), np.array([0, 1, 2, 99, 4, 5]))
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged" and report.exit_code == 1 and report.first_divergence is None
    assert report.reasons[0] == ("b has token 99 where a has 3 at position 3 of request r (a's request r but "
                                 "for that)")
    aux = next(t for t in report.tensors if t.name == "target.aux")
    assert aux.rows == 3 and aux.coverage.skipped_b == {"outside_shared_prefix": 3}  # past it: as before
    m = report.token_mismatch
    assert (m.request_b, m.position, m.token_a, m.token_b) == ("r", 3, 3, 99)
    e = report.text_edit
    assert (e.position, e.tokens_a, e.tokens_b, e.requests, e.every_request) == (3, [3], [99], 1, False)
    assert [(d.kind, d.severity) for d in report.diagnoses] == [("token_mismatch", "error")]
    assert td.compare(tmp_path / "a.h5", tmp_path / "b.h5", min_coverage=0.5).verdict == "diverged"


def test_align_by_step_for_same_producer_diffs(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6), request="x")
    changed = {k: v.copy() for k, v in layers.items()}
    changed[1][2] *= 1.01
    write(tmp_path / "b.h5", changed, (0, 1, 2), np.arange(6), request="y")  # other request ids
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", align="step")
    assert report.verdict == "diverged" and first_key(report) == ("target.layer.1", 2, 0)
    bad, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--align", "tokens")
    assert bad.returncode == 2 and "--align" in bad.stderr


def test_bad_inputs(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    (tmp_path / "x.h5").write_text("not a trace")
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "x.h5"))
    assert out.returncode == 2 and out.stderr.strip() == f"error: {tmp_path / 'x.h5'}: not a trace file " \
                                                         "(neither HDF5 nor Arrow IPC)"
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "a.h5"), "--tol", "target.*:cos=>1")
    assert out.returncode == 2 and "cannot read 'cos=>1'" in out.stderr
    with td.record(tmp_path / "other.h5") as rec:
        rec.log("something.else", np.zeros((2, 3), np.float32), token_ids=np.arange(2))
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "other.h5"))
    assert out.returncode == 2 and "not comparable" in out.stderr
    assert "no tensor name is in both" in out.stderr
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "a.h5"), "--min-coverage", "2")
    assert out.returncode == 2 and out.stderr.startswith("error: --min-coverage")


def test_tolerance_grammar() -> None:
    tol = Tolerances.parse(["draft.*:cos>=0.999, max_abs<=1e-2", "target.aux:rel_l2<0.5"])
    expected = {"cosine": (">=", 0.999), "max_abs": ("<=", 0.01)}
    assert tol.bounds("draft.hidden", ("float32", "float32")) == expected
    assert tol.bounds("target.aux", ("float32", "bfloat16")) == {"rel_l2": ("<", 0.5)}
    assert tol.bounds("target.layer.1", ("float32", "bfloat16"))["max_rel"] == ("<=", 3e-2)
    for bad in ("nocolon", "x:cos", "x:speed<1", "x:cos>=__import__('os')", "x:cos>=0.9,cosine<=1"):
        with pytest.raises(ValueError):
            Tolerances.parse([bad])


def decode_like(path, steps: int, bump_at: tuple[str, int] | None = None,
                names=("h.0", "h.1", "h.2")) -> None:
    """A serving-like trace: one row per step (position = step) of a few chained tensors."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 1000, steps)
    with td.record(path) as rec:
        for step in range(steps):
            x = rng.standard_normal((1, 16)).astype(np.float32)
            for name in names:
                x = np.tanh(x * 1.5)
                if bump_at == (name, step):
                    x = x * 1.01
                rec.log(name, x, step=step, request="r", positions=[step], token_ids=tokens[step : step + 1])


def test_stop_at_first_reads_no_further(tmp_path) -> None:
    decode_like(tmp_path / "a.h5", 40)
    decode_like(tmp_path / "b.arrow", 40, bump_at=("h.1", 3))
    full = td.compare(tmp_path / "a.h5", tmp_path / "b.arrow")
    early = td.compare(tmp_path / "a.h5", tmp_path / "b.arrow", stop_at_first=True)
    assert full.verdict == early.verdict == "diverged"
    assert early.first_divergence == full.first_divergence
    assert first_key(full) == ("h.1", 3, 0)
    assert statuses(full) == {"h.0": "match", "h.1": "diverged", "h.2": "downstream"}
    from tracediff.diff.differ import compare_traces
    from tracediff.diff.pair import Pair
    from tracediff.diff.plan import make_plan

    with td.open_trace(tmp_path / "a.h5") as a, td.open_trace(tmp_path / "b.arrow") as b:
        traces = Pair(a, b)  # a window per step:
        early = compare_traces(traces, make_plan(traces, chunk_bytes=1), stop_at_first=True)
    read = {t.name: (t.status, t.rows) for t in early.tensors}
    # steps 0..3 of every name were read, then it stopped at the end of step 3's window
    assert read == {"h.0": ("unchecked", 4), "h.1": ("diverged", 4), "h.2": ("downstream", 4)}


def first_key(report: Report) -> tuple:
    first = report.first_divergence
    return first.name, first.row.position, first.row.depth


def test_the_earliest_step_wins_over_dataflow_order(tmp_path) -> None:
    """h.2 fails at step 2, h.0 (upstream) only at step 30: the first divergence is h.2 at step 2,
    since h.0 still agreed when h.2 first went wrong."""
    decode_like(tmp_path / "a.h5", 40)
    decode_like(tmp_path / "b.h5", 40, bump_at=("h.2", 2))
    with td.record(tmp_path / "c.h5") as rec:  # b with h.0 also bumped at step 30
        with td.open_trace(tmp_path / "b.h5") as b:
            for name in b.names():
                for r in b.records(name=name):
                    data = r.data * (1.01 if (name, r.step) == ("h.0", 30) else 1)
                    rec.log(name, data, step=r.step, request="r", positions=r.position, token_ids=r.token_id)
    report = td.compare(tmp_path / "a.h5", tmp_path / "c.h5")
    assert report.verdict == "diverged" and first_key(report) == ("h.2", 2, 0)
    assert statuses(report)["h.0"] == "downstream"


def test_small_chunks_give_the_same_comparison(tmp_path) -> None:
    """Memory is bounded by the chunk size: tiny chunks must change nothing but the read pattern."""
    from tracediff.diff.differ import compare_traces
    from tracediff.diff.pair import Pair
    from tracediff.diff.plan import make_plan

    decode_like(tmp_path / "a.h5", 30)
    decode_like(tmp_path / "b.arrow", 30, bump_at=("h.1", 7))
    with td.open_trace(tmp_path / "a.h5") as a, td.open_trace(tmp_path / "b.arrow") as b:
        whole = compare_traces(Pair(a, b), make_plan(Pair(a, b)))
        tiny = compare_traces(Pair(a, b), make_plan(Pair(a, b), chunk_bytes=1))
        assert len(tiny.plan.chunks) == 90 and len(whole.plan.chunks) == 3  # a row each; a name each
        assert [vars(t) for t in tiny.tensors] == [vars(t) for t in whole.tensors]
    with td.record(tmp_path / "wide.h5") as rec:
        rec.log("w", np.arange(64 * 8, dtype=np.float32).reshape(64, 8), token_ids=np.arange(64))
    with td.open_trace(tmp_path / "wide.h5") as w:
        split = compare_traces(Pair(w, w), make_plan(Pair(w, w), chunk_bytes=100))  # 3 rows of 32 B a chunk
        assert len(split.plan.chunks) == 22 and split.tensors[0].rows == 64
        assert split.tensors[0].status == "match"


def test_name_mapping(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    bumped = {k: v.copy() for k, v in layers.items()}
    bumped[1][2] += 0.5
    with td.record(tmp_path / "other.h5") as rec:  # another producer's names
        rec.log("embed_tokens", bumped[-1].astype(np.float32), token_ids=np.arange(6))
        for i in range(5):
            rec.log(f"model.layers.{i}", bumped[i].astype(np.float32), token_ids=np.arange(6))
    assert td.compare(tmp_path / "a.h5", tmp_path / "other.h5").verdict == "incomparable"
    mapping = ["--map", "embed_tokens=target.embed"] + [f"--map=model.layers.{i}=target.layer.{i}"
                                                        for i in range(5)]
    out, report = command(str(tmp_path / "a.h5"), str(tmp_path / "other.h5"), "--json", *mapping)
    assert out.returncode == 1 and report["first_divergence"]["name"] == "target.layer.1"
    (tmp_path / "map.txt").write_text("# their name = ours\nembed_tokens = target.embed\n"
                                      + "".join(f"model.layers.{i} = target.layer.{i}\n" for i in range(5)))
    as_json = {f"model.layers.{i}": f"target.layer.{i}" for i in range(5)}
    (tmp_path / "map.json").write_text(json.dumps(as_json))
    for file in ("map.txt", "map.json"):
        out, report = command(str(tmp_path / "a.h5"), str(tmp_path / "other.h5"), "--json",
                          "--map-file", str(tmp_path / file))
        assert out.returncode == 1 and report["first_divergence"]["name"] == "target.layer.1"
    (tmp_path / "bad.txt").write_text("embed_tokens = target.embed\nmodel.layers.0 target.layer.0\n")
    a, other = str(tmp_path / "a.h5"), str(tmp_path / "other.h5")
    out, _ = command(a, other, "--map-file", str(tmp_path / "bad.txt"))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"error: {tmp_path / 'bad.txt'}: line 2: expected NAME_IN_B=NAME_IN_A, "
                                  "got 'model.layers.0 target.layer.0'")
    out, _ = command(a, other, "--map-file", str(tmp_path / "no.txt"))
    assert out.returncode == 2 and out.stderr.strip() == f"error: {tmp_path / 'no.txt'}: no such mapping file"


def test_an_empty_trace_is_refused(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    with td.record(tmp_path / "empty.arrow"):
        pass
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "empty.arrow"))
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: {tmp_path / 'empty.arrow'}: the trace holds no tensor rows"


def reference_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """The metric definitions, written plainly in float64 (docs/REPORT.md)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a - b)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    log_a = a - a.max(1, keepdims=True) - np.log(np.exp(a - a.max(1, keepdims=True)).sum(1, keepdims=True))
    log_b = b - b.max(1, keepdims=True) - np.log(np.exp(b - b.max(1, keepdims=True)).sum(1, keepdims=True))
    k = min(5, a.shape[1])
    top = lambda x: [set(np.argsort(-row, kind="stable")[:k].tolist()) for row in x]  # noqa: E731
    return {"max_abs": diff.max(1), "mean_abs": diff.mean(1), "rel_l2": np.linalg.norm(a - b, axis=1) / na,
            "cosine": (a * b).sum(1) / (na * nb), "max_rel": diff.max(1) / np.abs(a).max(1),
            "argmax_agree": (a.argmax(1) == b.argmax(1)).astype(float),
            "topk_overlap": np.array([len(x & y) / k for x, y in zip(top(a), top(b))]),
            "kl": (np.exp(log_a) * (log_a - log_b)).sum(1)}


def test_metrics_match_their_definitions() -> None:
    torch = pytest.importorskip("torch")
    from tracediff.diff.metrics import float_metrics, measure_rows

    rng = np.random.default_rng(3)
    a = (rng.standard_normal((40, 300)) * 2).astype(np.float32)
    b = a + (rng.standard_normal((40, 300)) * np.linspace(0, 1, 40)[:, None]).astype(np.float32)
    b[5] = a[5] * 3  # a scaled row: cosine exactly 1
    got, want = float_metrics(a, b, logits=True), reference_metrics(a, b)
    for name, expected in want.items():
        assert np.allclose(got[name], expected, rtol=1e-5, atol=1e-6), name
    assert got["cosine"][5] == pytest.approx(1.0, abs=1e-12) and got["kl"][0] == 0.0
    broken = b.copy()
    broken[7, 3], broken[9, 0] = np.nan, np.inf
    metrics = float_metrics(a, broken)
    assert np.isnan(metrics["max_abs"][[7, 9]]).all()
    assert np.isfinite(np.delete(metrics["max_abs"], [7, 9])).all()
    bf16 = torch.from_numpy(b).to(torch.bfloat16)
    raw = bf16.view(torch.int16).numpy().view(np.uint16)
    from_raw = measure_rows("x.logits", ("float32", "bfloat16"), a, raw)
    direct = float_metrics(a, bf16.float().numpy(), logits=True)
    assert all(np.array_equal(from_raw[k], direct[k]) for k in direct)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest even), as the uint16 patterns traces store."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("width", [1, 7, 64, 65, 300, 8195])
def test_bfloat16_metrics_match_their_definitions(width) -> None:
    """bfloat16 rows sum in float32 lanes and find their top-k from block maxima; rows too small
    or too large for float32 squares go the float64 way: every path gives the plain definitions."""
    from tracediff.diff.metrics import float_metrics
    from tracediff.trace.dtypes import decode

    rng = np.random.default_rng(width)
    a = rng.standard_normal((12, width)) * 3
    b = a + rng.standard_normal((12, width)) * np.linspace(0, 0.5, 12)[:, None]
    a[1], b[1] = a[1] * 1e-12, b[1] * 1e-12  # squares below float32's normal range
    a[2], b[2] = a[2] * 1e25, b[2] * 1e25  # squares beyond float32's range
    a[3, -1] = b[3, -1] = a[3].max() + 5  # the largest value in the last (partial) block
    a[4, :] = b[4, :] = 1.0  # every value tied: top-k by the earliest indices
    raw_a, raw_b = bf16_bits(a), bf16_bits(b)
    got, want = float_metrics(raw_a, raw_b, logits=True), reference_metrics(decode(raw_a, "bfloat16"),
                                                                             decode(raw_b, "bfloat16"))
    for name, expected in want.items():
        assert np.allclose(got[name], expected, rtol=2e-5, atol=1e-6), name
    assert got["topk_overlap"][4] == 1.0 and got["kl"][4] == 0.0 and got["cosine"][4] == 1.0


@pytest.mark.parametrize(("suffix", "compression"), [(".h5", "gzip"), (".arrow", "zstd")])
def test_rows_read_in_place_and_copied_compare_alike(tmp_path, suffix, compression) -> None:
    """bfloat16 on both sides of uncompressed single-file traces is read in place from the page
    cache; compressed (or rank-split) traces are copied out: both must give the same report."""
    torch = pytest.importorskip("torch")
    from tracediff.diff.differ import compare_traces, read_ahead
    from tracediff.diff.pair import Pair
    from tracediff.diff.plan import make_plan

    gen = torch.Generator().manual_seed(0)
    for name, scale, squeeze in (("a", 1.0, None), ("b", 1.1, None), ("az", 1.0, compression),
                                 ("bz", 1.1, compression)):
        with td.record(tmp_path / f"{name}{suffix}", compression=squeeze) as rec:
            gen.manual_seed(0)
            for step in range(12):
                x = torch.randn(3, 40, generator=gen)
                x[1, 5] = float("-inf")  # a masked logit, the same on both sides
                logits = x * (scale if step == 7 else 1.0)
                rec.log("h.logits", logits.to(torch.bfloat16), step=step, request=["r0", "r1", "r2"],
                        positions=[step] * 3, token_ids=[step * 3 + i for i in range(3)])
    results, in_place = [], []
    for a, b in (("a", "b"), ("az", "bz")):
        with td.open_trace(tmp_path / f"{a}{suffix}") as ta, td.open_trace(tmp_path / f"{b}{suffix}") as tb:
            comparison = compare_traces(Pair(ta, tb), make_plan(Pair(ta, tb), chunk_bytes=200))
            results.append([vars(t) for t in comparison.tensors])
            chunks = read_ahead(Pair(ta, tb), comparison.plan.chunks)
            in_place.append({rows.at is not None for _, rows in chunks})
    assert in_place == [{True}, {False}]
    assert results[0] == results[1]
    (tensor,) = results[0]
    assert tensor["status"] == "diverged"
    assert (tensor["first_bad"].step_a, tensor["first_bad"].step_b) == (7, 7)
    assert tensor["failed"] == 3 and tensor["rows"] == 36 and tensor["worst"]["kl"] > 0


def test_windows_mixing_in_place_and_copied_rows(tmp_path) -> None:
    """A window holds bfloat16 rows read in place and float64 rows copied into the read-ahead
    ring; with more windows than the ring has slots, every row must still be the one planned."""
    torch = pytest.importorskip("torch")
    from tracediff.diff.differ import WINDOWS_AHEAD, compare_traces, read_ahead
    from tracediff.diff.pair import Pair
    from tracediff.diff.plan import make_plan

    gen = torch.Generator().manual_seed(1)
    steps = [(torch.randn(2, 24, generator=gen), torch.randn(2, 16, generator=gen)) for _ in range(20)]
    for name, bump in (("a", None), ("b", 13)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            for step, (hidden, logits) in enumerate(steps):
                keys = dict(step=step, request=["r0", "r1"], positions=[step] * 2,
                            token_ids=[2 * step, 2 * step + 1])
                rec.log("h.hidden", (hidden * (1.001 if step == bump else 1.0)).double(), **keys)
                rec.log("h.logits", logits.to(torch.bfloat16), **keys)
    with td.open_trace(tmp_path / "a.h5") as ta, td.open_trace(tmp_path / "b.h5") as tb:
        whole = compare_traces(Pair(ta, tb), make_plan(Pair(ta, tb)))
        small = compare_traces(Pair(ta, tb), make_plan(Pair(ta, tb), chunk_bytes=300))
        windows = {c.window for c in small.plan.chunks}
        kinds = {(chunk.tensor.name, rows.at is not None) for chunk, rows in read_ahead(Pair(ta, tb),
                                                                                          small.plan.chunks)}
    assert len(windows) > WINDOWS_AHEAD + 1 and kinds == {("h.hidden", False), ("h.logits", True)}
    assert [vars(t) for t in small.tensors] == [vars(t) for t in whole.tensors]
    assert whole.first_divergence.name == "h.hidden" and whole.first_divergence.first_bad.step_a == 13


def test_read_ahead_holds_a_few_windows_whatever_the_trace_size(tmp_path) -> None:
    """Rows read in place are unmapped once their window is measured: resident memory grows by a
    few windows, not by the 2 x 64 MiB read."""
    torch = pytest.importorskip("torch")
    from tracediff.diff.differ import read_ahead
    from tracediff.diff.pair import Pair
    from tracediff.diff.plan import make_plan

    rows = torch.randn(8, 16384, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for name in ("a", "b"):
        with td.record(tmp_path / f"{name}.h5", on_full="block", block_timeout=60) as rec:
            for step in range(256):  # 256 KiB a step
                rec.log("h.logits", rows, step=step, request=[f"r{i}" for i in range(8)],
                        positions=[step] * 8, token_ids=np.arange(8) + 8 * step)

    def resident() -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmRSS"))

    with td.open_trace(tmp_path / "a.h5") as ta, td.open_trace(tmp_path / "b.h5") as tb:
        traces = Pair(ta, tb)
        plan = make_plan(traces, chunk_bytes=1 << 20)
        before, peak, total = resident(), 0, 0
        for _, chunk_rows in read_ahead(traces, plan.chunks):
            peak = max(peak, resident())
            total += len(chunk_rows.at.a)
    assert total == 256 * 8 and peak - before < 24 << 20


def test_rows_after_a_gap_in_positions_are_left_out(tmp_path) -> None:
    """A prefix is known only up to the first missing position: both sides lack position 2, so
    whatever token stood there is unknown and position 3 cannot be placed, even with equal keys."""
    values = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    tokens, kept = np.array([7, 8, 10]), [0, 1, 3]
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", values, request="x", positions=kept, token_ids=tokens)
    changed = values.copy()
    changed[2] *= 2  # only the row after the gap differs
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", changed, request="y", positions=kept, token_ids=tokens)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    (tensor,) = report.tensors
    assert report.verdict == "incomplete" and tensor.rows == 2 and tensor.failed == 0
    assert tensor.coverage.skipped_a == tensor.coverage.skipped_b == {"prefix_unknown": 1}


def test_a_tol_rule_that_bounds_no_metric_of_a_tensor_leaves_the_defaults(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    tripled = {k: v * 3 + 5 for k, v in layers.items()}
    write(tmp_path / "b.h5", tripled, (0, 1, 2), np.arange(6))
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", tol=["*:argmax_agree>=1"])
    assert report.verdict == "diverged"
    assert "--tol *:argmax_agree bounds no metric of this tensor" in report.tensors[0].note
    ints = Tolerances.parse(["draft.token:equal>=1"])
    assert ints.bounds("draft.token", ("int64", "int64"), ["equal"]) == {"equal": (">=", 1.0)}


def test_a_map_onto_a_name_b_already_has_is_refused(tmp_path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("t.x", x, token_ids=np.arange(4))
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("t.x", x + 10, token_ids=np.arange(4))
        rec.log("t.y", x, token_ids=np.arange(4))
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--map", "t.y=t.x")
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --map: 't.x' and 't.y' of b would both be compared as 't.x': map one of them to another name")
    with pytest.raises(td.InputError, match="would hide 't.x'"):  # moving b's own t.x away hides it
        td.compare(tmp_path / "a.h5", tmp_path / "b.h5", rename={"t.y": "t.x", "t.x": "t.old"})


def test_static_tensors_are_compared(tmp_path) -> None:
    """A vocab map or a weight logged with log_static is compared as one row: a regenerated d2t
    is a divergence even when every per-token row agrees."""
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    for name, d2t in (("a", np.arange(8)), ("b", np.arange(8) + 1), ("c", np.arange(8))):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("t", x, token_ids=np.arange(4))
            rec.log_static("draft.d2t", d2t)
            rec.log_static("fc.weight", x * (1.5 if name == "c" else 1))
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged" and report.first_divergence.name == "draft.d2t"
    assert [d.kind for d in report.diagnoses] == ["vocab_map"] and statuses(report)["fc.weight"] == "match"
    report = td.compare(tmp_path / "a.h5", tmp_path / "c.h5")
    assert report.verdict == "diverged" and report.first_divergence.name == "fc.weight"


def test_a_map_that_would_hide_a_shared_tensor_is_refused(tmp_path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    for name in ("a", "b"):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("t", x, token_ids=np.arange(4))
            rec.log("u", x + (name == "b"), token_ids=np.arange(4))
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--map", "u=uu")
    assert out.returncode == 2 and "a has no tensor named 'uu'" in out.stderr
    out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--map", "u=t", "--map", "u=x")
    assert out.returncode == 2 and out.stderr.strip() == "error: --map: 'u' is mapped twice"


def test_static_names_obey_the_map_rules_and_kinds_never_mix_silently(tmp_path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    for name, w, v in (("a", 1, 0), ("b", 5, 1)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("t", x, token_ids=np.arange(4))
            rec.log_static("w", np.full(3, w))
            rec.log_static("v", np.full(3, v))
    with pytest.raises(td.InputError, match="would both be compared as 'w'"):
        td.compare(tmp_path / "a.h5", tmp_path / "b.h5", rename={"v": "w"})
    with pytest.raises(td.InputError, match="would hide 'w'"):
        td.compare(tmp_path / "a.h5", tmp_path / "b.h5", rename={"w": "draft.d2t"})
    with td.record(tmp_path / "c.h5") as rec:  # w per token here, static in a
        rec.log("t", x, token_ids=np.arange(4))
        rec.log("w", x, token_ids=np.arange(4))
        rec.log_static("v", np.full(3, 0))
    report = td.compare(tmp_path / "a.h5", tmp_path / "c.h5")
    assert report.verdict == "incomplete" and statuses(report)["w"] == "mixed_records"
    assert next(t.note for t in report.tensors if t.name == "w") == "a: static"


def test_a_name_mapped_twice_in_a_file_and_a_glob_given_twice_are_refused(tmp_path, layers) -> None:
    write(tmp_path / "a.h5", layers, (0, 1, 2), np.arange(6))
    (tmp_path / "twice.txt").write_text("H = target.embed\nH = target.aux\n")
    (tmp_path / "twice.json").write_text('{"H": "target.embed", "H": "target.aux"}')
    for name in ("twice.txt", "twice.json"):
        out, _ = command(str(tmp_path / "a.h5"), str(tmp_path / "a.h5"), "--map-file", str(tmp_path / name))
        assert out.returncode == 2 and out.stderr.strip() == f"error: {tmp_path / name}: 'H' is mapped twice"
    with pytest.raises(ValueError, match="given twice"):
        Tolerances.parse(["h:max_rel<=1", "h:max_rel<=1e-9"])
