"""Compare on everyday chat traffic: every prompt starts with BOS, two share a system prompt, one is
a multi-turn follow-up served from the prefix cache (a radix-cache hit), two share their first
tokens. Training (the TTT pass over each conversation) and serving (the reference decoder) run the
same tiny target and draft, so a clean pair must be `match`, and a real fault must still be found.
Draft rows are keyed by the token they were fed too: rows of two conversations that share a prefix
through t but go on differently at t + 1 are never paired."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from testbed.train import greedy_sequences, record_ttt, ttt_pass  # noqa: E402
from tests.conftest import REPO, tiny_eagle3  # noqa: E402
from tracediff.bundle.build import make_bundle  # noqa: E402
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft  # noqa: E402
from tracediff.report.compare import headline, to_markdown  # noqa: E402

SAMPLES = REPO / "traces" / "eagle3"  # the committed sample target and its trained draft
SPEC = AuxSpec((-1, 1, 3))  # what the sample draft was trained on
BOS = 1
SYSTEM = [BOS, 50, 51, 52, 53]
NEW_TOKENS, STEPS = 8, 4
ORDER = ["sys", "p_a", "chat", "p_b", "other"]


def conversations(target) -> dict[str, tuple[list[int], int]]:
    """request -> (prompt, positions served from the prefix cache). "chat" is the second turn of
    "sys": its whole first turn (prompt and answer) is in the cache."""
    first = SYSTEM + [60, 61, 62]
    answer = greedy_sequences(target, torch.tensor([first]), NEW_TOKENS)[0].tolist()
    return {
        "sys": (first, 0),
        "p_a": ([BOS, 5, 77, 300, 12, 9, 41], 0),
        "chat": (answer + [70, 71, 72], len(answer)),
        "p_b": ([BOS, 5, 77, 300, 12, 200, 201], 5),
        "other": ([BOS, 9, 8, 7], 1),
    }


def serve(target, draft, path, conventions: Conventions, steps: int = STEPS,
          asked: int | None = None) -> dict[str, list[int]]:
    """``asked``: the draft tokens the user asked for (the server resolved ``steps`` + 1)."""
    decoder = SpeculativeDecoder(target, draft, conventions, num_steps=steps)
    texts = {}
    meta = decoder.contract()
    if asked is not None:
        meta["speculative_args_requested"] = {**meta["speculative_args"], "num_draft_tokens": asked}
    with td.record(path, source="serving", meta=meta) as rec:
        decoder.rec = rec
        chats = conversations(target)
        for k, request in enumerate(ORDER):
            prompt, cached = chats[request]
            texts[request] = decoder.decode(f"rid-{k}", prompt, NEW_TOKENS, cached=cached).tokens
    return texts


def train(target, draft, path, texts: dict[str, list[int]], length: int = STEPS,
          spec: AuxSpec = SPEC) -> None:
    """One TTT pass per conversation, in another order than serving's, under other request ids."""
    with td.record(path, source="training", meta={"ttt_length": length}) as rec, torch.no_grad():
        for k, request in enumerate(sorted(texts, reverse=True)):
            seqs = greedy_sequences(target, torch.tensor([texts[request]]), length + 1)
            record_ttt(rec, draft, ttt_pass(draft, target, seqs, spec, length), seqs, [f"sample{k}"], step=k)


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    target = transformers.LlamaForCausalLM.from_pretrained(SAMPLES / "target").eval()
    return target, load_draft(SAMPLES / "draft", target.model.embed_tokens.weight.detach())


@pytest.fixture(scope="module")
def chat(models, tmp_path_factory):
    target, draft = models
    root = tmp_path_factory.mktemp("chat")
    texts = serve(target, draft, root / "serving.h5", Conventions(SPEC))
    train(target, draft, root / "training.h5", texts)
    return target, draft, root, texts


@pytest.mark.slow
def test_clean_chat_traffic_matches(chat) -> None:
    root = chat[2]
    report = td.compare(root / "training.h5", root / "serving.h5")
    assert report.first_divergence is None, (report.first_divergence, [d.message for d in report.diagnoses])
    assert report.verdict == "match", report.reasons
    draft_ids = next(t for t in report.tensors if t.name == "draft.input_ids")
    assert draft_ids.coverage.compared_b > 0 and draft_ids.status == "match"


@pytest.mark.slow
def test_depth0_draft_rows_pair_only_with_the_same_next_token(chat) -> None:
    """Every row `show A B` finds for a compared depth-0 draft row holds the same fed token on both
    sides: conversations that share BOS (or five tokens) are never paired with each other."""
    root = chat[2]
    with td.open_trace(root / "training.h5") as a, td.open_trace(root / "serving.h5") as b:
        plan = td.diff.plan.make_plan(td.diff.pair.Pair(a, b))
        tensor = next(t for t in plan.tensors if t.name == "draft.input_ids")
        rows = tensor.matched.rows
        values = [trace.gather(keys, picked).reshape(len(picked), -1)[:, 0]
                  for trace, keys, picked in ((a, tensor.keys.a, rows.a), (b, tensor.keys.b, rows.b))]
        assert len(rows.a) > 20
        assert (values[0] == values[1]).all()


@pytest.mark.slow
def test_a_real_fault_is_not_hidden_behind_shared_prefixes(chat, tmp_path) -> None:
    target, draft, root, _ = chat
    serve(target, draft, tmp_path / "bug.h5", Conventions(AuxSpec((1, 3, 5))))
    report = td.compare(root / "training.h5", tmp_path / "bug.h5")
    assert report.verdict == "diverged"
    assert report.first_divergence.name == "target.aux"
    assert [d.kind for d in report.diagnoses][:1] == ["aux_layer_set"]


@pytest.mark.slow
def test_the_verdict_says_what_it_rests_on_per_draft_depth(chat) -> None:
    root = chat[2]
    report = td.compare(root / "training.h5", root / "serving.h5")
    depths = report.coverage.depths
    assert [d.depth for d in depths] == list(range(STEPS))
    assert all(d.aligned > 0 for d in depths) and depths[0].aligned > depths[1].aligned
    rows = [t.coverage.aligned for t in report.tensors if t.coverage is not None and not t.static]
    assert sum(d.aligned for d in depths) == sum(rows)
    line = headline(report)
    assert line.startswith(f"match ({report.coverage.aligned} rows compared, coverage 100%; depth 0: "
                           f"{depths[0].aligned} rows, 1: {depths[1].aligned}, ")
    assert f"Compared per draft depth: depth 0: {depths[0].aligned} rows" in to_markdown(report)
    assert td.Report.from_json(report.to_json()).coverage.depths == depths


@pytest.mark.slow
def test_depths_where_no_row_was_comparable_are_never_covered(tmp_path) -> None:
    """An untrained draft: its chains never draft what training was fed at depth >= 1, so no row
    there is comparable. That is not a match at those depths."""
    target, draft = tiny_eagle3()
    texts = serve(target, draft, tmp_path / "serving.h5", Conventions(AuxSpec((0, 1, 2))))
    train(target, draft, tmp_path / "training.h5", texts, spec=AuxSpec((0, 1, 2)))
    report = td.compare(tmp_path / "training.h5", tmp_path / "serving.h5")
    assert report.first_divergence is None and report.verdict == "incomplete"
    assert [d.aligned > 0 for d in report.coverage.depths] == [True, False, False, False]
    assert report.reasons[-1].startswith(f"depths 1-{STEPS - 1}: no row comparable (")
    assert report.reasons[-1].endswith("the two sides drafted other tokens")
    depth0 = report.coverage.depths[0].aligned
    assert f"depth 0: {depth0} rows, 1-{STEPS - 1}: none comparable" in headline(report)


@pytest.mark.slow
def test_serving_that_drafts_fewer_depths_than_training_trained_is_named(chat, tmp_path) -> None:
    """The founding story's clamp: 16 draft tokens asked for, num_steps 2 with topk 1 resolves 3,
    training unrolled 4 depths: depths 2-3 are never served."""
    target, draft, root, _ = chat
    serve(target, draft, tmp_path / "clamped.h5", Conventions(SPEC), steps=2, asked=16)
    report = td.compare(root / "training.h5", tmp_path / "clamped.h5")
    assert report.verdict == "incomplete" and report.exit_code == 3
    assert "depths 2-3: only a recorded rows there" in report.reasons[-1]
    (d,) = [d for d in report.diagnoses if d.kind == "draft_depths"]
    assert d.severity == "warning"
    assert d.message == ("serving drafts 2 tokens per verify (num_steps 2, topk 1, num_draft_tokens 3); "
                         "16 draft tokens were asked for and the server resolved 3; training trained 4 "
                         "depths (ttt_length 4): depths 2-3 never served, so never compared")
    assert (d.evidence.depths_a, d.evidence.depths_b, d.evidence.never_compared) == (4, 2, [2, 3])
    assert headline(report).startswith("incomplete (") and "2-3: only a recorded" in headline(report)
    swapped = td.compare(tmp_path / "clamped.h5", root / "training.h5")  # serving as the baseline
    (e,) = [e for e in swapped.diagnoses if e.kind == "draft_depths"]
    assert e.message == d.message and (e.evidence.depths_a, e.evidence.depths_b) == (2, 4)
    # a bundle's slices must never compare those depths either, or they do not reproduce the verdict
    bundle = make_bundle(root / "training.h5", tmp_path / "clamped.h5", tmp_path / "bundle")
    assert bundle.verification.reproduced
    assert "draft depths never compared (2, 3)" in (tmp_path / "bundle" / "report.md").read_text()


@pytest.mark.slow
def test_training_fed_other_text_is_a_divergence_at_the_tokens(chat, tmp_path) -> None:
    """Issue 36: training's chat template doubled the BOS of every conversation, or one prompt
    differs at one position: both traces are whole, the sides were fed other text, and that is
    what the first line says (not `incomplete`)."""
    target, draft, root, texts = chat
    train(target, draft, tmp_path / "bos.h5", {k: [BOS] + v for k, v in texts.items()})
    report = td.compare(tmp_path / "bos.h5", root / "serving.h5")
    assert report.verdict == "diverged" and report.exit_code == 1
    said = "serving lacks training's token 1 at position 1 of every request"
    assert report.reasons[0] == said and headline(report).startswith(f"diverged: {said} (")
    one = {k: v[:4] + [v[4] + 7] + v[5:] if k == "p_a" else v for k, v in texts.items()}
    train(target, draft, tmp_path / "one.h5", one)
    report = td.compare(tmp_path / "one.h5", root / "serving.h5")
    partner = f"sample{sorted(texts, reverse=True).index('p_a')}"  # train()'s request ids
    assert report.verdict == "diverged" and report.first_divergence is None
    assert report.reasons[0] == (f"serving has token 12 where training has 19 at position 4 of request rid-1 "
                                 f"(training's request {partner} but for that)")
    nobos = {k: v[1:] for k, v in texts.items()}
    train(target, draft, tmp_path / "nobos.h5", nobos)
    report = td.compare(tmp_path / "nobos.h5", root / "serving.h5")
    assert report.verdict == "incomparable"
    assert report.reasons[0].startswith("serving has an extra token 1 at position 0 of every request")
