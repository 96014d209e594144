"""diff/edits.py and the verdict it drives (issue 36): text both sides recorded that differs by an edit
(a token replaced, added or left out) is a divergence at the tokens, or makes the pair incomparable
where nothing is shared; two conversations sharing a system prompt are never an edit."""

from __future__ import annotations

import tracediff as td
from tests.test_compare_coverage import per_token
from tracediff.report.compare import headline, to_markdown

SYSTEM = [1, 50, 51, 52, 53, 54]  # BOS and a system prompt every request shares
USERS = {"q0": [60, 61, 62, 63, 64, 65, 66, 67, 68], "q1": [70, 71, 72, 73, 74, 75, 76, 77],
         "q2": [60, 61, 62, 90, 91, 92, 93, 94, 95, 96], "q3": [80, 81, 82, 83, 84, 85, 86, 87, 88]}


def record(path, texts: dict[str, list[int]], source: str) -> None:
    """One row a token of every text, each request's token table declared (as a server's)."""
    with td.record(path, source=source) as rec:
        for request, tokens in texts.items():
            rec.request_tokens(request, tokens)
            rec.log("target.layer.0", per_token(tokens), token_ids=tokens, request=request)


def chats(**edits) -> dict[str, list[int]]:
    return {r: edits.get(r, SYSTEM + user) for r, user in USERS.items()}


def compare(tmp_path, training: dict, serving: dict):
    record(tmp_path / "training.h5", training, "training")
    record(tmp_path / "serving.h5", serving, "serving")
    return td.compare(tmp_path / "training.h5", tmp_path / "serving.h5")


def test_an_extra_bos_in_every_request_where_nothing_else_is_shared_is_incomparable_and_says_so(tmp_path):
    report = compare(tmp_path, {r: t[1:] for r, t in chats().items()}, chats())
    assert report.verdict == "incomparable" and report.exit_code == 2
    said = "serving has an extra token 1 at position 0 of every request"
    assert report.reasons[0] == said + " (a BOS that one side's chat template adds?)"
    assert headline(report).startswith("incomparable: " + said)
    e = report.text_edit
    assert (e.position, e.tokens_a, e.tokens_b, e.requests, e.every_request) == (0, [], [1], 4, True)


def test_a_doubled_bos_in_every_request_is_a_divergence_in_one_line(tmp_path):
    report = compare(tmp_path, chats(), {r: [1] + t for r, t in chats().items()})
    assert report.verdict == "diverged" and report.exit_code == 1 and report.first_divergence is None
    assert report.reasons[0] == "serving has an extra token 1 at position 1 of every request"
    line = headline(report)
    assert line.startswith("diverged: serving has an extra token 1 at position 1 of every request (")
    assert line.index("rows compared") > line.index("every request")  # coverage after the finding
    assert [(d.kind, d.severity) for d in report.diagnoses] == [("token_mismatch", "error")]
    assert "- diverged: serving has an extra token 1 at position 1 of every request" in to_markdown(report)
    assert td.Report.from_json(report.to_json()).text_edit == report.text_edit


def test_one_token_of_one_request_names_that_request_and_its_true_partner(tmp_path):
    """The edit makes q0's text follow q2's one token further than its own: the partner is q0's own
    text, found past the edit, not the request sharing the longest prefix."""
    edited = SYSTEM + [60, 61, 62, 90, 64, 65, 66, 67, 68]  # 63 -> 90, q2's token there
    report = compare(tmp_path, chats(), chats(q0=edited))
    assert report.verdict == "diverged"
    assert report.reasons[0] == ("serving has token 90 where training has 63 at position 9 of request q0 "
                                 "(training's request q0 but for that)")
    left = report.token_mismatch  # where q0 leaves every text of training: q2, sharing more of it
    assert (left.request_a, left.position) == ("q2", 10)
    assert report.tokens.request_a == "q0" and report.tokens.first_difference == 9


def test_a_token_left_out_and_several_requests_differing(tmp_path):
    serving = chats(q1=SYSTEM + [70, 71, 73, 74, 75, 76, 77],
                    q3=SYSTEM + [80, 81, 82, 83, 55, 84, 85, 86, 87, 88])
    report = compare(tmp_path, chats(), serving)
    assert report.verdict == "diverged" and report.text_edit.requests == 2
    assert report.reasons[0] == ("serving lacks training's token 72 at position 8 of request q1 (training's "
                                 "request q1 but for that; 2 requests differ so)")


def test_conversations_sharing_a_system_prompt_are_no_edit(tmp_path):
    """Serving answered other questions after the same system prompt, and one it shares: clean
    traffic. Rows past the shared prompt are not comparable: coverage says so, no divergence."""
    others = {"s0": SYSTEM + [60, 61, 62, 63, 64, 65, 66, 67, 68],  # q0 again
              "s1": SYSTEM + [40, 41, 42, 43, 44, 45, 46, 47], "s2": SYSTEM + [60, 61, 62, 30, 31, 32, 33],
              "s3": SYSTEM + [70, 12, 13, 14, 15, 16, 17, 18]}
    report = compare(tmp_path, chats(), others)
    assert report.text_edit is None and report.verdict == "incomplete", report.reasons
    assert report.token_mismatch is not None  # where they part is still said, as a warning
    assert [(d.kind, d.severity) for d in report.diagnoses] == [("token_mismatch", "warning")]


def test_a_different_answer_to_the_same_prompt_is_no_edit(tmp_path):
    """Serving sampled another answer: the texts part and never agree again."""
    prompt = SYSTEM + [60, 61, 62]
    report = compare(tmp_path, {"r": prompt + [5, 6, 7, 8, 9, 10, 11]},
                     {"r": prompt + [25, 26, 27, 28, 29, 30, 31]})
    assert report.text_edit is None and report.verdict == "incomplete"


def test_the_same_edit_in_every_request_is_said_once_in_either_order(tmp_path):
    training = chats(**{r: SYSTEM[:3] + [7] + SYSTEM[4:] + u for r, u in USERS.items()})
    report = compare(tmp_path, training, chats())
    assert report.reasons[0] == "serving has token 52 where training has 7 at position 3 of every request"
    swapped = td.compare(tmp_path / "serving.h5", tmp_path / "training.h5")
    assert swapped.reasons[0] == "training has token 7 where serving has 52 at position 3 of every request"


def test_answers_that_part_and_fall_into_one_loop_or_end_apart_are_no_edit(tmp_path):
    """From an adversarial review: another first answer token, then the same repetition loop on both
    sides, or one side's answer ending one token after it parts: other answers, not one text."""
    prompt = SYSTEM + [60, 61]
    report = compare(tmp_path, {"r": prompt + [5] + [7] * 10}, {"r": prompt + [6] + [7] * 10})
    assert report.text_edit is None and report.verdict == "incomplete"
    report = compare(tmp_path, {"r": prompt + [5, 9]}, {"r": prompt + [6, 9, 11, 12, 13, 14]})
    assert report.text_edit is None and report.verdict == "incomplete"
    report = compare(tmp_path, {"r": prompt + [5, 9]}, {"r": prompt + [6, 8]})  # two endings
    assert report.text_edit is None


def test_the_last_token_replaced_is_an_edit(tmp_path):
    texts = chats()
    report = compare(tmp_path, texts, chats(q1=texts["q1"][:-1] + [999]))
    assert report.verdict == "diverged"
    assert report.reasons[0] == ("serving has token 999 where training has 77 at position 13 of request q1 "
                                 "(training's request q1 but for that)")


def test_an_edit_is_found_in_either_order(tmp_path):
    """q0's edit at position 0 makes it share nothing, while the others share the system prompt:
    from the other side, q0 of training leaves serving only after the system prompt; and of three
    copies of one prompt, serving edited one: training's copies all have a copy on serving."""
    record(tmp_path / "training.h5", chats(), "training")
    record(tmp_path / "serving.h5", chats(q0=[2] + chats()["q0"][1:]), "serving")
    for a, b, said in (("training", "serving", "serving has token 2 where training has 1"),
                       ("serving", "training", "training has token 1 where serving has 2")):
        report = td.compare(tmp_path / f"{a}.h5", tmp_path / f"{b}.h5")
        assert report.verdict == "diverged"
        assert report.reasons[0].startswith(f"{said} at position 0 of request q0")
    prompt = SYSTEM + [60, 61, 62, 63, 64, 65, 66, 67]
    record(tmp_path / "copies.h5", {f"c{i}": prompt for i in range(3)}, "training")
    edited = {"c0": prompt, "c1": prompt[:9] + [99] + prompt[10:], "c2": prompt}
    record(tmp_path / "edited.h5", edited, "serving")
    for a, b in (("copies", "edited"), ("edited", "copies")):
        report = td.compare(tmp_path / f"{a}.h5", tmp_path / f"{b}.h5")
        assert report.verdict == "diverged" and report.text_edit.position == 9, (a, b, report.reasons)
