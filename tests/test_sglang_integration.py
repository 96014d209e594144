"""Recording SGLang 0.5.23's real serving code (CPU harness): every canonical name with content keys,
values checked against HF transformers on the same weights, the aux wiring the contract states, the
draft's vocab mapping, prefix-cache hits, request filters, reused rids, the version guard, host
safety, compare on two serving runs, and the harness's argument checks."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import torch  # noqa: E402

import tracediff as td  # noqa: E402
from testbed.sglang_cpu import CpuServer, tiny_checkpoint  # noqa: E402
from tracediff.integrations import sglang as integration  # noqa: E402

pytestmark = pytest.mark.slow  # SGLang's real serving code: each module fixture serves a batch
AUX_IDS = (1, 3, 5)  # the draft config's eagle_aux_hidden_state_layer_ids (output of layers 1, 3, 5)
LAYERS, STEPS, NEW = 8, 3, 5
A = [5, 17, 42, 99, 3, 250, 7, 301, 12]
B = [5, 17, 42, 99, 8, 9]  # shares 4 tokens with A: 3 positions served from A's KV cache
C = [60, 61, 62]
PROMPTS = {"a": A, "b": B, "c": C}
CACHED = {"a": 0, "b": 3, "c": 0}  # where prefills start: the radix cache of EAGLE matches bigrams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), aux_ids=AUX_IDS, layers=LAYERS)


def serve(ckpt, path, draft_weights=None, **options):
    """One serving run of PROMPTS into a trace at ``path``; returns each request's full tokens."""
    target_dir, target_weights, draft_dir, weights = ckpt
    with td.record(path, source="serving") as rec:
        server = CpuServer(target_dir, target_weights, draft_dir, draft_weights or weights, num_steps=STEPS,
                           recorder=rec, **options)
        out = server.serve(list(PROMPTS.values()), NEW, rids=list(PROMPTS))
        server.close()
    return {rid: PROMPTS[rid] + new for rid, new in zip(PROMPTS, out)}


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "serve.h5"
    tokens = serve(ckpt, path, num_draft_tokens=16)  # SGLang resolves num_steps + 1 with topk 1
    with td.open_trace(path) as trace:
        yield trace, tokens


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoConfig, LlamaForCausalLM

    target_dir, target_weights, _, _ = ckpt
    model = LlamaForCausalLM(AutoConfig.from_pretrained(target_dir)).eval()
    model.load_state_dict(target_weights)
    return model


def by_key(rows, depth: int | None = None) -> dict:
    """(request, position, step, depth) -> row value."""
    values = rows.numpy()
    keep = np.ones(len(rows), bool) if depth is None else rows.depth == depth
    return {(r, int(p), int(s), int(d)): values[i] for i, (r, p, s, d) in
            enumerate(zip(rows.request, rows.position, rows.step, rows.depth)) if keep[i]}


def fed(rid: str) -> range:
    """Positions of a request the target ran: its prefill from the cached prefix, then one decode
    row per new token but the last."""
    return range(CACHED[rid], len(PROMPTS[rid]) + NEW - 1)


def test_every_name_has_content_keys(served):
    """Target and depth-0 draft rows at position t carry (rid, t, x[t]); the draft was fed x[t+1];
    chain rows at depth d carry their anchor's key and were fed the previous depth's token."""
    trace, tokens = served
    names = set(trace.names())
    expected = {"target.embed", "target.aux", "target.logits", "target.token", "target.final_hidden",
                *(f"target.layer.{i}" for i in range(LAYERS)), "draft.input_ids", "draft.positions",
                "draft.embed", "draft.fc_in", "draft.fc_out", "draft.hidden", "draft.logits", "draft.token",
                "draft.token_target", "draft.d2t"}
    assert expected <= names
    for name in ("target.embed", f"target.layer.{LAYERS - 1}", "target.aux", "draft.fc_in", "draft.hidden"):
        rows = trace.rows(name, depth=0)
        got = sorted(zip(rows.request.tolist(), rows.position.tolist(), rows.token_id.tolist()))
        want = sorted((rid, t, tokens[rid][t]) for rid in PROMPTS for t in fed(rid))
        assert got == want, name
    inputs = trace.rows("draft.input_ids", depth=0)
    assert [tokens[r][p + 1] for r, p in zip(inputs.request, inputs.position)] == inputs.numpy().tolist()
    chain_ids, chain_pos = trace.rows("draft.input_ids"), trace.rows("draft.positions")
    drafted = by_key(trace.rows("draft.token_target"))
    for depth in range(1, STEPS):
        at = chain_ids.depth == depth
        anchors = set(zip(chain_ids.request[at].tolist(), chain_ids.position[at].tolist()))
        assert anchors == {(rid, t) for rid in PROMPTS for t in fed(rid) if t >= len(PROMPTS[rid]) - 1}
        for r, p, s, fed_id in zip(chain_ids.request[at], chain_ids.position[at], chain_ids.step[at],
                                   chain_ids.numpy()[at]):
            assert fed_id == drafted[(r, int(p), int(s), depth - 1)]  # depth d is fed depth d-1's token
        rope = chain_pos.numpy()[chain_pos.depth == depth]
        assert (rope == chain_pos.position[chain_pos.depth == depth] + depth).all()  # SGLang: anchor + d
    table = trace.request_tokens()
    for rid in PROMPTS:  # the token table holds each request's tokens the scheduler knew, prefix included
        positions, ids = table.sequence(rid)
        assert positions.tolist() == list(range(len(PROMPTS[rid]) + NEW - 1))
        assert ids.tolist() == tokens[rid][: len(PROMPTS[rid]) + NEW - 1]


def test_target_layers_equal_hf_hidden_states(served, hf):
    """target.layer.i == HF hidden_states[i+1] (the residual stream SGLang never returns from a
    layer), the last layer's output before the final norm, target.final_hidden after it, and the
    logits, at every recorded row, on the same weights."""
    from tracediff.eagle3.capture import run_target

    trace, tokens = served
    for rid in PROMPTS:
        ids = torch.tensor([tokens[rid][: len(PROMPTS[rid]) + NEW - 1]])
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
        hooked = run_target(hf, ids).states
        reference = {"target.embed": out.hidden_states[0][0], "target.final_hidden": out.hidden_states[-1][0],
                     **{f"target.layer.{i}": out.hidden_states[i + 1][0] for i in range(LAYERS - 1)},
                     f"target.layer.{LAYERS - 1}": hooked[f"target.layer.{LAYERS - 1}"][0]}
        for name, want in reference.items():
            rows = trace.rows(name, request=rid)
            assert rows.position.tolist() == list(fed(rid))
            np.testing.assert_allclose(rows.numpy(), want[rows.position].numpy(), atol=2e-5, rtol=1e-4,
                                       err_msg=name)
        logits = trace.rows("target.logits", request=rid)
        np.testing.assert_allclose(logits.numpy(), out.logits[0, logits.position].numpy(), atol=2e-5,
                                   rtol=1e-4)
        assert (trace.rows("target.token", request=rid).numpy() == logits.numpy().argmax(-1)).all()


def test_aux_is_the_contracts_sources_and_feeds_the_draft(served):
    """target.aux == concat of the target.layer.* the contract names (SGLang: id i -> output of layer
    i, ascending); draft.fc_in == target.aux row for row."""
    trace, _ = served
    stated = trace.contract
    assert stated["aux_layer_ids"] == list(AUX_IDS)
    assert stated["layers_to_capture"] == [i + 1 for i in AUX_IDS]
    assert stated["aux_sources"] == [f"target.layer.{i}" for i in AUX_IDS]
    assert stated["aux_layer_convention"] == "output_of_layer"
    aux = by_key(trace.rows("target.aux"))
    slots = [by_key(trace.rows(name)) for name in stated["aux_sources"]]
    assert all(np.array_equal(value, np.concatenate([s[key] for s in slots])) for key, value in aux.items())
    fc_in = by_key(trace.rows("draft.fc_in"))
    assert fc_in.keys() == aux.keys()
    assert all(np.array_equal(fc_in[key], aux[key]) for key in aux)


def test_draft_tokens_map_through_hot_token_id(served, ckpt):
    """draft.token_target (what draft_forward returned) == hot_token_id[argmax draft.logits], with
    hot_token_id = d2t + arange from the recorded static draft.d2t."""
    trace, _ = served
    d2t = next(r for r in trace.records(name="draft.d2t")).numpy()
    assert np.array_equal(d2t, ckpt[3]["d2t"].numpy())
    stated = trace.contract
    assert stated["speculative_args"] == {"algorithm": "EAGLE3", "num_steps": STEPS, "topk": 1,
                                          "num_draft_tokens": STEPS + 1}
    # what the user asked for, beside what SGLang resolved: compare names the clamp from the two
    assert stated["speculative_args_requested"]["num_draft_tokens"] == 16
    hot = d2t + np.arange(len(d2t))
    logits, token, target = (by_key(trace.rows(name))
                             for name in ("draft.logits", "draft.token", "draft.token_target"))
    assert logits.keys() == token.keys() == target.keys()
    assert {key[3] for key in target} == set(range(STEPS))
    for key, row in logits.items():
        assert token[key] == row.argmax() and target[key] == hot[row.argmax()]


def test_prefix_cache_hit_aligns_by_content(ckpt, served, tmp_path):
    """b reuses a's KV for 3 positions: its rows start at position 3 and equal, key for key, the rows
    of b served alone (no cache hit), so they align by content."""
    trace, _ = served
    alone_path = tmp_path / "b_alone.h5"
    target_dir, target_weights, draft_dir, draft_weights = ckpt
    with td.record(alone_path, source="serving") as rec:
        server = CpuServer(*ckpt, num_steps=STEPS, recorder=rec)
        server.serve([B], NEW, rids=["b"])
        server.close()
    with td.open_trace(alone_path) as alone:
        for name in ("target.layer.3", "target.aux", "draft.hidden", "draft.logits"):
            hit = by_key(trace.rows(name, request="b"))
            full = by_key(alone.rows(name, request="b"))
            if name != "draft.logits":  # (draft logits exist for each step's last row only)
                assert min(key[1] for key in hit) == CACHED["b"] and min(key[1] for key in full) == 0
            shared = {(r, p, d) for r, p, _, d in hit} & {(r, p, d) for r, p, _, d in full}
            assert shared == {(r, p, d) for r, p, _, d in hit}
            ours = {(r, p, d): v for (r, p, _, d), v in hit.items()}
            for (r, p, _, d), value in full.items():
                if (r, p, d) in ours:
                    np.testing.assert_allclose(ours[(r, p, d)], value, atol=1e-5, err_msg=name)


def test_request_filters(ckpt, tmp_path):
    """requests=N records the first N requests seen; match_prefix those whose tokens start so."""
    serve(ckpt, tmp_path / "first.h5", requests=1)
    serve(ckpt, tmp_path / "prefix.h5", match_prefix=[5, 17, 42, 99, 8])
    for path, wanted in (("first.h5", {"a"}), ("prefix.h5", {"b"})):
        with td.open_trace(tmp_path / path) as trace:
            for name in ("target.layer.0", "draft.hidden", "draft.token_target"):
                assert set(trace.rows(name).request.tolist()) == wanted, (path, name)
            assert set(trace.request_tokens().requests()) == wanted


def test_logits_topk_bounds_the_logits(ckpt, served, tmp_path):
    serve(ckpt, tmp_path / "top.h5", logits_topk=4)
    with td.open_trace(tmp_path / "top.h5") as trace:
        top = trace.rows("target.logits")
        ids = trace.rows("target.logits_topk_ids").numpy()
        assert top.numpy().shape[1] == 4 and trace.contract["target_logits"].startswith("top4")
    full = by_key(served[0].rows("target.logits"))
    for i, key in enumerate(zip(top.request, top.position, top.step, top.depth)):
        row = full[(key[0], int(key[1]), int(key[2]), int(key[3]))]
        assert ids[i].tolist() == np.argsort(-row)[:4].tolist()
        np.testing.assert_array_equal(top.numpy()[i], row[ids[i]])


def test_capture_gives_training_features_for_other_ids(ckpt, hf, tmp_path):
    """capture() with a training config's ids on the target alone: aux == HF hidden_states[i+1] for
    those ids, the final hidden and logits == HF's; the trace's contract states the capture ids."""
    target_dir, target_weights, draft_dir, draft_weights = ckpt
    with td.record(tmp_path / "cap.h5", source="training") as rec:
        server = CpuServer(target_dir, target_weights, recorder=rec)
        features = server.capture([A, C], aux_ids=[0, 2, 6])
        server.close()
    for prompt, feature in zip((A, C), features):
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[i + 1][0] for i in (0, 2, 6)], -1)
        torch.testing.assert_close(feature.aux, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(feature.last_hidden, out.hidden_states[-1][0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(feature.logits, out.logits[0], atol=2e-5, rtol=1e-4)
    with td.open_trace(tmp_path / "cap.h5") as trace:
        assert trace.contract["aux_layer_ids"] == [0, 2, 6]
        assert trace.contract["aux_sources"] == ["target.layer.0", "target.layer.2", "target.layer.6"]
        rows = trace.rows("target.aux")
        assert rows.position.tolist() == list(range(len(A))) + list(range(len(C)))
        np.testing.assert_array_equal(rows.numpy(), torch.cat([f.aux for f in features]).numpy())
    serving = CpuServer(target_dir, target_weights, draft_dir, draft_weights)
    serving.capture([C], aux_ids=[0, 2, 6])
    assert serving.target.model.layers_to_capture == [i + 1 for i in AUX_IDS]  # the serving ids, restored


def test_version_guard_names_the_missing_internal(ckpt):
    """An internal that is missing or changed stops install before anything attaches."""
    target_dir, target_weights, draft_dir, draft_weights = ckpt
    server = CpuServer(target_dir, target_weights, draft_dir, draft_weights)
    rec = td.record(server.server_args.model_path + "/unused.h5", enabled=False)
    del server.target.model.layers_to_capture
    with pytest.raises(integration.SglangInternalsError, match=r"sglang 0\.5\.23: sglang\.srt\.models\."
                       r"llama\.LlamaForCausalLM has no text model with layers_to_capture and layers"):
        integration.install(rec, target=server.target, draft=server.draft, worker=server.worker)
    assert not server.target.model._forward_pre_hooks and not server.draft.model._forward_pre_hooks

    class OldWorker:  # a worker from a release that renamed hot_token_id
        topk, speculative_num_steps = 1, STEPS

    with pytest.raises(integration.SglangInternalsError, match=r"EagleDraftWorker\.hot_token_id"):
        integration.install(rec, draft=server.draft, worker=OldWorker())
    assert not server.draft.model._forward_pre_hooks


def test_hook_failure_stops_recording_not_serving(ckpt, tmp_path, caplog):
    """A recorder that raises (strict mode, a clashing earlier record) stops recording once, with one
    warning; serving goes on and produces what an unrecorded server produces."""
    target_dir, target_weights, draft_dir, draft_weights = ckpt
    plain = CpuServer(target_dir, target_weights, draft_dir, draft_weights, num_steps=STEPS)
    expected = plain.serve(list(PROMPTS.values()), NEW)
    with td.record(tmp_path / "strict.h5", source="serving", strict=True) as rec:
        rec.log("target.logits", torch.zeros(1, 3, dtype=torch.int64), request="x", token_ids=[0])
        server = CpuServer(*ckpt, num_steps=STEPS, recorder=rec)
        with caplog.at_level(logging.WARNING, logger="tracediff"):
            assert server.serve(list(PROMPTS.values()), NEW) == expected
        stopped = server.installation.stopped
        assert stopped and "target logits" in stopped
        assert not server.target.model._forward_pre_hooks and not server.draft.model._forward_hooks
    warnings = [r for r in caplog.records if "SGLang recording stopped" in r.getMessage()]
    assert len(warnings) == 1
    with td.open_trace(tmp_path / "strict.h5") as trace:
        assert trace.contract["sglang_recording_stopped"] == stopped
        assert trace.rows("target.embed").step.max() == 0  # recorded up to the failing forward only


def test_compare_two_serving_runs(ckpt, served, tmp_path):
    """Two runs of the same harness match with full coverage; a changed draft weight diverges at
    the draft's first tensor it changes."""
    again = tmp_path / "again.h5"
    serve(ckpt, again)
    report = td.compare(served[0], again)
    assert report.verdict == "match", report.reasons
    assert report.coverage.fraction == 1.0 and report.coverage.rows_a == report.coverage.aligned
    changed = dict(ckpt[3])
    changed["midlayer.mlp.down_proj.weight"] = changed["midlayer.mlp.down_proj.weight"] * 1.5
    other = tmp_path / "changed.h5"
    serve(ckpt, other, draft_weights=changed)
    report = td.compare(served[0], other)
    assert report.verdict == "diverged"
    assert report.first_divergence is not None and report.first_divergence.name == "draft.hidden"
    assert {t.name for t in report.tensors if t.status == "match"} >= {"target.aux", "draft.fc_out"}
    assert json.loads(report.to_json())["verdict"] == "diverged"


def serve_in_turn(ckpt, path, calls, **options):
    """One server, one serve call per (rid, prompt), one after the other: each request finishes
    before the next arrives, as a client reusing a rid sees it."""
    with td.record(path, source="serving") as rec:
        server = CpuServer(*ckpt, num_steps=STEPS, recorder=rec, **options)
        for rid, prompt in calls:
            server.serve([prompt], 3, rids=[rid])
        server.close()


def test_reused_rid_is_a_request_of_its_own(ckpt, tmp_path):
    """A rid reused for a later request names it rid#2 (then the first free rid#n) at prefill,
    decode and in its draft chains; the same computation under distinct rids matches it in full."""
    first, second = [1, 2, 3, 7], [1, 2, 4, 8]
    serve_in_turn(ckpt, tmp_path / "reused.h5", [("x", first), ("x", second), ("x#3", C), ("x", C)])
    serve_in_turn(ckpt, tmp_path / "distinct.h5", [("p", first), ("q", second), ("r", C), ("s", C)])
    with td.open_trace(tmp_path / "reused.h5") as trace:
        table = trace.request_tokens()
        assert sorted(table.requests()) == ["x", "x#2", "x#3", "x#4"]
        for rid, prompt in (("x", first), ("x#2", second), ("x#3", C), ("x#4", C)):
            assert table.sequence(rid)[1].tolist()[: len(prompt)] == prompt
        for name in ("target.embed", "draft.hidden", "draft.token_target"):
            rows = trace.rows(name)
            assert set(rows.request.tolist()) == {"x", "x#2", "x#3", "x#4"}, name
        chain = trace.rows("draft.input_ids")
        assert {r for r, d in zip(chain.request, chain.depth) if d > 0} == {"x", "x#2", "x#3", "x#4"}
        for rid in ("x", "x#2"):  # each request's rows carry its own tokens (x#2 at position 2: 4, not 3)
            rows = trace.rows("target.embed", request=rid)
            _, ids = table.sequence(rid)
            assert rows.token_id.tolist() == ids[rows.position].tolist()
            assert ids[2] == (first if rid == "x" else second)[2]
    report = td.compare(tmp_path / "distinct.h5", tmp_path / "reused.h5")
    assert report.verdict == "match", report.reasons
    assert report.coverage.fraction == 1.0 and report.coverage.rows_a == report.coverage.aligned


def test_request_filters_decide_per_request_not_per_rid(ckpt, tmp_path):
    """requests=1 records the first request only, not a later one under its rid; match_prefix
    judges each request under a reused rid by its own prompt."""
    calls = [("x", A), ("x", B)]
    serve_in_turn(ckpt, tmp_path / "first.h5", calls, requests=1)
    serve_in_turn(ckpt, tmp_path / "prefix.h5", calls, match_prefix=B[:5])
    for path, (name, prompt) in (("first.h5", ("x", A)), ("prefix.h5", ("x#2", B))):
        with td.open_trace(tmp_path / path) as trace:
            assert list(trace.request_tokens().requests()) == [name], path
            assert trace.request_tokens().sequence(name)[1].tolist()[: len(prompt)] == prompt
            assert set(trace.rows("target.layer.0").request.tolist()) == {name}, path


@pytest.fixture(scope="module")
def plain_server(ckpt):
    return CpuServer(*ckpt, num_steps=STEPS)


@pytest.mark.parametrize(("prompts", "rids", "problem"), [
    ([A, B], ["only"], r"1 rids for 2 prompts"),
    ([A, B], ["x", "x"], r"duplicate rids in one call: \['x'\]"),
    ([A, []], None, r"prompt 1 is empty"),
    ([[1, 512, 3]], None, r"prompt 0 has token ids outside the vocab \[0, 512\): \[512\]"),
    ([[1, -2, 3]], None, r"prompt 0 has token ids outside the vocab"),
    ([list(range(1, 300))], None, r"prompt 0: 299 tokens \+ 2 new > max_len 256"),
    ([], None, r"no prompts to serve"),
    ([A, B], "ab", r"rids must be a list of non-empty strings"),
    ([A], [5], r"rids must be a list of non-empty strings"),
    ([A], [""], r"rids must be a list of non-empty strings"),
    ([1, 2, 3], None, r"prompt 0 is not a list of token ids"),
    ([[1, 2.7, 3]], None, r"prompt 0 holds token ids that are not ints"),
])
def test_serve_refuses_bad_arguments_before_running(plain_server, prompts, rids, problem):
    """Each bad argument is one ValueError naming it, raised before any request is admitted."""
    with pytest.raises(ValueError, match=problem):
        plain_server.serve(prompts, 2, rids=rids)
    assert not plain_server.running


@pytest.mark.parametrize("new_tokens", [0, 2.5, True])
def test_serve_refuses_a_bad_token_count_before_running(plain_server, new_tokens):
    with pytest.raises(ValueError, match="new_tokens must be an int >= 1"):
        plain_server.serve([A], new_tokens)
    assert not plain_server.running

