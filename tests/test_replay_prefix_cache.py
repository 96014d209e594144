"""Replay on chat traffic served with the prefix cache: a request whose first rows came from the
cache borrows them from a recorded request whose text agrees there, even when the two part right
after the cached rows (a whole system prompt cached); a request whose cached rows no recorded
request holds is left out and named, never replayed without its context (which would blame the
checkpoint for the server's cache)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from tests.conftest import REPO, cli  # noqa: E402
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding  # noqa: E402
from tracediff.eagle3.explain import explain_traces  # noqa: E402
from tracediff.eagle3.replay import replay  # noqa: E402
from tracediff.errors import InputError  # noqa: E402

S = REPO / "traces" / "eagle3"
SYSTEM = [1, 50, 51, 52, 53, 54, 55]


@pytest.fixture(scope="module")
def models():
    import transformers

    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM.from_pretrained(S / "target").eval()
    return target, load_draft(S / "draft", target_embedding(S / "target"))


def serve(models, path, plan: list[tuple[str, list[int], int]], steps: int = 3) -> None:
    """``plan``: (request, prompt, positions served from the prefix cache)."""
    target, draft = models
    decoder = SpeculativeDecoder(target, draft, Conventions(AuxSpec((-1, 1, 3))), num_steps=steps)
    with td.record(path, source="serving", meta=decoder.contract()) as rec:
        decoder.rec = rec
        for request, prompt, cached in plan:
            decoder.decode(request, prompt, 8, cached=cached)


CHAT = [("first", SYSTEM + [60, 61], 0), ("second", SYSTEM + [70, 71, 72], len(SYSTEM)),
        ("third", SYSTEM + [80], len(SYSTEM)), ("other", [1, 9, 8, 7], 1)]


def test_a_whole_cached_system_prompt_is_borrowed_and_every_chain_reproduces(models, tmp_path) -> None:
    path = tmp_path / "chat.h5"
    serve(models, path, CHAT)
    with td.open_trace(path) as trace:
        report = replay(trace, models[1])
    assert report.requests == 4 and report.requests_without_context == []
    check = report.self_check
    assert check is not None and check.chains > 0 and check.reproduced == check.chains, check


def test_cached_rows_no_recorded_request_holds_leave_the_request_out(models, tmp_path) -> None:
    path = tmp_path / "late.h5"
    serve(models, path, CHAT[:2])
    late = tmp_path / "without_first.h5"
    done = cli("slice", str(path), "-o", str(late), "--requests", "second")
    assert done.returncode == 0, done.stderr
    with td.open_trace(late) as trace:
        with pytest.raises(InputError, match="replay has no request with its context: the rows of all 1 "
                                             "start past position 0"):
            replay(trace, models[1])
    mixed = tmp_path / "mixed.h5"
    serve(models, mixed, [CHAT[1], ("fresh", [1, 9, 8, 7], 0)])  # "second" cached from a request not recorded
    with td.open_trace(mixed) as trace:
        report = replay(trace, models[1])
    assert report.requests == 1 and report.requests_without_context == ["second"]
    assert report.self_check is not None and report.self_check.reproduced == report.self_check.chains
    shown = cli("replay", str(mixed), "--draft", str(S / "draft"), "--target", str(S / "target"))
    assert "left out: 1 requests whose rows start past position 0" in " ".join(shown.stdout.split())


def test_explain_says_why_requests_went_unpaired(models, tmp_path) -> None:
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    serve(models, a, CHAT)
    # B: "second" cached from a request B did not record; "other" borrows its BOS row from "fresh",
    # whose text it repeats: A's one "other" pairs with one of them
    serve(models, b, [("fresh", [1, 9, 8, 7], 0), CHAT[1], CHAT[3]])
    draft = models[1]
    with td.open_trace(a) as ta, td.open_trace(a) as same:
        itself = explain_traces(ta, same, {"a": draft, "b": draft})
    assert "nothing to explain" in itself.conclusion
    assert itself.unpaired == {side: {"no_shared_text": 0, "partner_taken": 0, "no_context": 0}
                               for side in "ab"}
    assert itself.rows_left == {"a": 0, "b": 0}
    with td.open_trace(a) as ta, td.open_trace(b) as tb:
        ex = explain_traces(ta, tb, {"a": draft, "b": draft})
    assert ex.requests == 1
    assert ex.unpaired == {"a": {"no_shared_text": 3, "partner_taken": 0, "no_context": 0},
                           "b": {"no_shared_text": 0, "partner_taken": 1, "no_context": 1}}
    assert ex.rows_left["a"] > 0 and ex.rows_left["b"] > 0
    assert ex.conclusion.endswith(
        "(on the request pairs only: 3 of A's requests share no text with the other side; 1 of B's requests "
        "share text only with requests paired on more of theirs; 1 of B's requests lack their first rows (a "
        "prefix-cache hit on rows no recorded request holds), never replayed)"), ex.conclusion


def test_two_servers_give_the_same_figures_in_either_order(models, tmp_path) -> None:
    """Both sides serving: the chains are the rows either server drafted from, the chain as long as
    the longer server's; the trace named as the user names it (a rank-split trace by its stem)."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    serve(models, a, CHAT)
    # another chain length: B's server verified at other rows than A's
    serve(models, b, [CHAT[2], CHAT[0], ("fresh", [1, 9, 8, 7, 6], 0)], steps=1)
    draft = {"a": models[1], "b": models[1]}
    with td.open_trace(a) as ta, td.open_trace(b) as tb:
        forward = explain_traces(ta, tb, draft)
        backward = explain_traces(tb, ta, draft)
    assert forward.scored_on == backward.scored_on == "both servers' chains"
    assert forward.depths == backward.depths == 3  # the longer server's chain
    assert forward.run("A's inputs").chains == backward.run("B's inputs").chains
    assert forward.run("A's inputs").expected_accept_len == backward.run("B's inputs").expected_accept_len
    assert forward.run("B's inputs").own_accept_len == backward.run("A's inputs").own_accept_len
    assert (forward.a, forward.b) == (str(a), str(b))


def test_a_rank_split_trace_is_named_by_the_path_that_opens_it(tmp_path) -> None:
    import numpy as np

    for rank in (0, 1):
        with td.record(tmp_path / "run.h5", source="serving", rank=rank, world_size=2) as rec:
            rec.log("target.token", np.arange(2), request=f"r{rank}", positions=np.arange(2),
                    token_ids=[1, 2])
    with td.open_trace(tmp_path / "run.h5") as trace:
        assert len(trace.paths) == 2 and trace.name == str(tmp_path / "run.h5")
    with td.open_trace(tmp_path / "run.rank1.h5") as one:
        assert one.name == str(tmp_path / "run.rank1.h5")
