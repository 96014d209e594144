"""Every verdict says what it compared: the cases where compare used to claim `match` on a fraction of
the rows, or crashed, on traces shaped like real serving. Each builds real trace files with the
recorder and compares them in-process with ``td.compare``."""

from __future__ import annotations

import numpy as np
import pytest

import tracediff as td
from tracediff.diff.results import REPORT_VERSION, Report

H = 8


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H)).astype(np.float32)


def per_token(tokens, seed: int = 0) -> np.ndarray:
    """A hidden state that depends only on the token prefix, as a causal model's would."""
    out, state = [], np.zeros(H)
    for t in np.asarray(tokens).reshape(-1).tolist():
        state = np.tanh(state * 0.5 + np.random.default_rng(t + 1000 * seed).standard_normal(H))
        out.append(state.copy())
    return np.array(out, dtype=np.float32)


def tensor(report: Report, name: str):
    return next(t for t in report.tensors if t.name == name)


def test_every_copy_of_a_repeated_prompt_is_compared(tmp_path) -> None:
    batch = np.array([[5, 6, 7], [5, 6, 7]])
    x = np.stack([per_token(batch[0]), per_token(batch[1])])
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", x, token_ids=batch, request=["p", "q"])
    y = x.copy()
    y[1] += 1000
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", y, token_ids=batch, request=["u", "v"])
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged" and report.exit_code == 1
    assert report.first_divergence.row.request_a == "q" and report.first_divergence.row.request_b == "v"
    assert tensor(report, "h").coverage.aligned == 6 and tensor(report, "h").rows == 6
    with td.record(tmp_path / "c.h5") as rec:  # a third copy on one side only: compared with copy 0
        rec.log("h", np.concatenate([x, x[:1]]), token_ids=np.concatenate([batch, batch[:1]]))
    report = td.compare(tmp_path / "a.h5", tmp_path / "c.h5", min_coverage=1.0)
    h = tensor(report, "h").coverage
    assert report.verdict == "match" and h.aligned == 9 and h.skipped_b == {}
    with td.record(tmp_path / "d.h5") as rec:  # ... so a third copy that differs is found
        rec.log("h", np.concatenate([x, x[:1] + 100]), token_ids=np.concatenate([batch, batch[:1]]))
    report = td.compare(tmp_path / "a.h5", tmp_path / "d.h5")
    assert report.verdict == "diverged" and report.first_divergence.row.request_b == "s0b2"


def test_depth_rows_without_fed_tokens_are_counted_not_a_crash(tmp_path) -> None:
    """No draft.input_ids: depth-1 rows cannot be paired by what they were fed, and the last depth-0
    row was fed a token (x[4]) that neither side's token table holds."""
    tokens = np.arange(4)
    for name in ("a", "b"):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("draft.hidden", per_token(tokens), token_ids=tokens, depth=0)
            rec.log("draft.hidden", per_token(tokens, seed=1), token_ids=tokens, depth=1)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    hidden = tensor(report, "draft.hidden").coverage
    assert hidden.aligned == 3 and hidden.skipped_a == hidden.skipped_b == {"fed_unknown": 5}
    assert report.verdict == "incomplete" and report.exit_code == 3
    assert "fed tokens unknown" in report.reasons[0]
    assert "depth 1: no row comparable" in report.reasons[-1]
    # where it falls short, found once from the compare's own alignment, travels with the report
    assert report.shortfall.tensors == ["draft.hidden"] and report.shortfall.position == 3
    assert td.Report.from_json(report.to_json()).shortfall == report.shortfall


def test_padding_is_counted_and_never_compared(tmp_path) -> None:
    prompts = [[3, 4, 5, 6], [8, 9]]
    with td.record(tmp_path / "one_by_one.h5") as rec:
        for i, p in enumerate(prompts):
            rec.log("h", per_token(p), token_ids=p, request=f"r{i}")
    padded = np.array([[3, 4, 5, 6], [0, 0, 8, 9]])
    mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1]])
    x = np.stack([per_token(prompts[0]), np.concatenate([rows(2, 5), per_token(prompts[1])])])
    with td.record(tmp_path / "batch.h5") as rec:
        rec.log("h", x, token_ids=padded, attention_mask=mask, request=["x", "y"])
    report = td.compare(tmp_path / "one_by_one.h5", tmp_path / "batch.h5")
    h = tensor(report, "h").coverage
    assert report.verdict == "match", report.reasons
    assert h.aligned == 6 and h.skipped_b == {"padding": 2} and h.fraction == 1.0
    with td.record(tmp_path / "unmarked.h5") as rec:  # the same batch, padding not marked
        rec.log("h", x, token_ids=padded, request=["x", "y"])
    report = td.compare(tmp_path / "one_by_one.h5", tmp_path / "unmarked.h5")
    # unmarked, the padding is text: request y was fed two tokens r1 never was (issue 36: a divergence)
    assert report.verdict == "diverged" and tensor(report, "h").coverage.aligned == 4
    assert report.reasons[0] == ("b has 2 extra tokens [0, 0] at position 0 of request y (a's request r1 but "
                                 "for that)")
    assert "outside the shared token prefix" in report.reasons[1]


def test_sampled_decode_steps_align_by_the_learned_tokens(tmp_path) -> None:
    tokens = np.array([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    for name in ("a", "b"):
        with td.record(tmp_path / f"{name}.h5", every=2) as rec:
            for step, t in enumerate(tokens):
                rec.log("h", per_token(tokens[: step + 1])[-1:], step=step, request="r", positions=[step],
                        token_ids=[t])
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "match" and tensor(report, "h").coverage.aligned == 5


def test_rows_after_a_gap_with_unknown_tokens_are_reported(tmp_path) -> None:
    tokens = np.arange(20, 30)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", per_token(tokens), token_ids=tokens, request="r")
    with td.record(tmp_path / "b.h5") as rec:  # positions 3..5 never seen: later rows' prefix unknown
        keep = np.r_[0:3, 6:10]
        rec.log("h", per_token(tokens)[keep], token_ids=tokens[keep], positions=keep, request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    h = tensor(report, "h").coverage
    assert report.verdict == "incomplete" and h.aligned == 3 and h.skipped_b == {"prefix_unknown": 4}


def test_a_prefix_cache_hit_aligns_by_the_declared_tokens(tmp_path) -> None:
    tokens = np.array([7, 8, 9, 10, 11, 12])
    with td.record(tmp_path / "train.h5") as rec:
        rec.log("h", per_token(tokens), token_ids=tokens, request="sample")
    with td.record(tmp_path / "serve.h5") as rec:  # positions 0-2 came from the prefix cache
        rec.request_tokens("req", tokens)
        rec.log("h", per_token(tokens)[3:], token_ids=tokens[3:], positions=np.arange(3, 6), request="req")
    report = td.compare(tmp_path / "train.h5", tmp_path / "serve.h5")
    assert report.verdict == "match" and tensor(report, "h").coverage.aligned == 3
    with td.record(tmp_path / "undeclared.h5") as rec:
        rec.log("h", per_token(tokens)[3:], token_ids=tokens[3:], positions=np.arange(3, 6), request="req")
    report = td.compare(tmp_path / "train.h5", tmp_path / "undeclared.h5")
    assert report.verdict == "incomplete" and tensor(report, "h").coverage.skipped_b == {"prefix_unknown": 3}
    report = td.compare(tmp_path / "train.h5", tmp_path / "undeclared.h5", align="step")  # by step, position
    assert report.verdict == "match" and tensor(report, "h").coverage.aligned == 3


def test_a_shape_mismatch_is_its_own_status_with_a_likely_cause(tmp_path) -> None:
    tokens = np.arange(4)
    for name, width in (("a", 8), ("b", 4)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("h", rows(4)[:, :width], token_ids=tokens)
            rec.log("g", per_token(tokens), token_ids=tokens)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    h = tensor(report, "h")
    assert h.status == "shape_mismatch" and h.shapes == ([8], [4])
    assert "tensor-parallel shard (1/2 of the row)" in h.note
    assert report.verdict == "incomplete" and report.reasons[0].startswith("h: shape mismatch")


def test_a_dtype_changing_between_steps_is_reported(tmp_path) -> None:
    tokens = np.arange(4)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", per_token(tokens), token_ids=tokens, step=0)
        rec.log("h", per_token(tokens).astype(np.float16), token_ids=tokens, step=1)
        rec.log("g", per_token(tokens), token_ids=tokens)
    report = td.compare(tmp_path / "a.h5", tmp_path / "a.h5")
    assert tensor(report, "h").status == "mixed_records" and report.verdict == "incomplete"


def test_unrelated_traces_are_incomparable_in_both_alignments(tmp_path) -> None:
    for name, first, model in (("a", 100, "llama-a"), ("b", 500, "llama-b")):
        with td.record(tmp_path / f"{name}.h5", meta={"target_model": model}) as rec:
            rec.log("h", rows(6), token_ids=np.arange(first, first + 6))
    for align in ("prefix", "step"):
        report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", align=align)
        assert report.verdict == "incomparable" and report.exit_code == 2
        # a target's name is not its identity (a path, a display name): the tokens decide here
        assert report.reasons == ["the traces share no token prefix: their requests' tokens differ from the "
                                  "start"]


def test_a_differing_token_is_the_cause_of_the_draft_row_that_embeds_it(tmp_path) -> None:
    a_tokens, b_tokens = np.array([1, 2, 3, 4, 5]), np.array([1, 2, 3, 9, 5])
    for name, tokens in (("a", a_tokens), ("b", b_tokens)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("target.layer.0", per_token(tokens), token_ids=tokens, request=name)
            # draft row t embeds token t + 1
            rec.log("draft.embed", per_token(np.r_[tokens[1:], 0], seed=2), token_ids=tokens, request=name)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    # the draft row at 2 was fed 4 on one side and 9 on the other: rows of two continuations are never
    # paired; the differing token is named, and it is the divergence (issue 36)
    assert report.verdict == "diverged" and report.first_divergence is None
    embed = tensor(report, "draft.embed").coverage
    assert embed.aligned == 2 and embed.skipped_b.get("outside_shared_prefix") == 2
    (d,) = report.diagnoses
    assert d.kind == "token_mismatch"
    assert d.evidence.position == 3 and (d.evidence.token_a, d.evidence.token_b) == (4, 9)


def test_the_report_round_trips_through_json(tmp_path) -> None:
    tokens = np.arange(6)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", per_token(tokens), token_ids=tokens)
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", per_token(tokens) * 1.5, token_ids=tokens[:5].tolist() + [77])
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.diagnoses and report.token_mismatch is not None and report.first_divergence is not None
    again = Report.from_json(report.to_json())
    assert again == report and again.to_json() == report.to_json()
    with pytest.raises(ValueError):
        Report.from_json(report.to_json().replace('"diverged"', '"maybe"', 1))


def test_progress_hears_every_byte_compared(tmp_path) -> None:
    tokens = np.arange(40)
    for name in ("a", "b"):
        with td.record(tmp_path / f"{name}.h5") as rec:
            for step in range(4):
                at = slice(step * 10, step * 10 + 10)
                rec.log("h", per_token(tokens)[at], step=step, request="r", positions=np.arange(40)[at],
                        token_ids=tokens[at])
    heard: list[tuple[int, int]] = []
    td.compare(tmp_path / "a.h5", tmp_path / "b.h5", chunk_bytes=H * 4 * 10,
               progress=lambda *p: heard.append(p))
    assert len(heard) == 4 and heard[-1] == (2 * 40 * H * 4, 2 * 40 * H * 4)
    assert [done for done, _ in heard] == sorted(done for done, _ in heard)


def test_the_command_says_incomplete_with_exit_3_and_what_it_left_out(tmp_path) -> None:
    from tests.conftest import cli

    kept = np.r_[0:3, 6:10]
    tokens = np.arange(20, 30)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", per_token(tokens), token_ids=tokens, request="r")
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", per_token(tokens)[kept], token_ids=tokens[kept], positions=kept, request="r")
    text = cli("compare", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"))
    assert text.returncode == 3, text.stderr
    assert text.stdout.splitlines()[0] == (
        "incomplete (3 rows compared, coverage 43%): h: 3 / 3 of 10 / 7 rows compared (43%); "
        "not compared: a 7 not recorded on the other side, b 4 prefix unknown")
    md = cli("compare", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--markdown")
    assert md.returncode == 3 and "- incomplete: h: 3 / 3 of 10 / 7 rows compared (43%)" in md.stdout
    assert "Not compared, b: 4 prefix unknown." in md.stdout


def test_steps_the_other_recorder_skipped_are_named_in_step_alignment(tmp_path) -> None:
    tokens = np.arange(50, 58)
    for name, every in (("a", 1), ("b", 2)):
        with td.record(tmp_path / f"{name}.h5", every=every) as rec:
            for step, t in enumerate(tokens):
                rec.log("h", per_token(tokens[: step + 1])[-1:], step=step, request=name, positions=[step],
                        token_ids=[t])
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", align="step")
    h = tensor(report, "h").coverage
    assert report.verdict == "match" and h.aligned == 4 and h.skipped_a == {"filtered_step": 4}


def test_copies_of_one_key_never_pair_with_another_tokens_rows(tmp_path) -> None:
    """The k-th copy of token t's row and the t-th copy of token k's row must not share a pair key."""
    x = rows(2)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", x, request=["r0", "r1"], token_ids=[0, 0], positions=[0, 0])
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", x[[1, 0]], request=["q0", "q1"], token_ids=[1, 0], positions=[0, 0])
    h = tensor(td.compare(tmp_path / "a.h5", tmp_path / "b.h5"), "h").coverage
    assert h.aligned == 2 and h.skipped_b == {"outside_shared_prefix": 1}  # a's two copies of token 0: q1
    with td.record(tmp_path / "c.h5") as rec:
        rec.log("h", rows(3), request=["r0", "r1", "r2"], token_ids=[0, 1, 0], positions=[0, 0, 0])
    report = td.compare(tmp_path / "c.h5", tmp_path / "c.h5")
    assert report.verdict == "match" and tensor(report, "h").coverage.aligned == 3


def test_a_tensor_with_no_comparable_row_on_one_side_is_not_a_match(tmp_path) -> None:
    tokens = np.arange(10, 14)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", rows(4), token_ids=tokens, request="r")
    with td.record(tmp_path / "b.h5") as rec:  # every row padding
        rec.log("h", rows(4) + 1, token_ids=tokens, positions=[-1] * 4, request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "incomplete" and report.reasons[0].startswith("h: no row compared")


def test_mixed_records_are_counted_and_incomplete_even_alone(tmp_path) -> None:
    tokens = np.arange(4)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", per_token(tokens), token_ids=tokens, step=0)
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", per_token(tokens), token_ids=tokens, step=0)
        rec.log("h", per_token(tokens).astype(np.float16) + 100, token_ids=tokens, step=1)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    h = tensor(report, "h")
    assert report.verdict == "incomplete" and h.status == "mixed_records"
    assert h.note == "b: dtypes float16, float32" and (h.coverage.rows_a, h.coverage.rows_b) == (4, 8)
    assert report.coverage.skipped_b == {"mixed_records": 8}


def test_step_alignment_does_not_compare_rows_of_other_text(tmp_path) -> None:
    x = rows(4)
    for name, tokens in (("a", [10, 11, 12, 13]), ("b", [10, 11, 99, 99])):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("h", x, token_ids=tokens, request=name)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", align="step")
    h = tensor(report, "h").coverage
    assert report.verdict == "incomplete" and h.aligned == 2
    assert h.skipped_a == h.skipped_b == {"outside_shared_prefix": 2}


def test_draft_tree_branches_pair_by_the_token_they_were_fed(tmp_path) -> None:
    """Two depth-1 branches of one root (top-k 2), logged in another order on each side: each branch
    is compared with the branch fed the same token, whatever its place."""
    branch = {t: rows(1, t) for t in (7, 8, 9)}

    def write(path, order, bump=None) -> None:
        with td.record(path) as rec:
            rec.request_tokens("r", [5, 6])  # the root row was fed 6
            rec.log("draft.hidden", rows(1), token_ids=[5], request="r", depth=0)
            keys = dict(token_ids=[5, 5], positions=[0, 0], request="r", depth=1)
            rec.log("draft.input_ids", np.array(order), **keys)
            hidden = np.concatenate([branch[t] + (1 if t == bump else 0) for t in order])
            rec.log("draft.hidden", hidden, **keys)

    write(tmp_path / "a.h5", [7, 9])
    write(tmp_path / "b.h5", [9, 7])
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    hidden = tensor(report, "draft.hidden").coverage
    assert report.verdict == "match" and hidden.aligned == 3 and hidden.skipped_a == {}
    write(tmp_path / "c.h5", [9, 7], bump=9)
    report = td.compare(tmp_path / "a.h5", tmp_path / "c.h5")
    assert report.verdict == "diverged" and report.first_divergence.row.depth == 1
    write(tmp_path / "d.h5", [9, 8])  # the branch fed 8 has no counterpart: not comparable, excused
    hidden = tensor(td.compare(tmp_path / "a.h5", tmp_path / "d.h5"), "draft.hidden").coverage
    assert hidden.aligned == 2 and hidden.skipped_a == hidden.skipped_b == {"fed_differs": 1}


def test_copies_on_one_side_do_not_inflate_the_coverage(tmp_path) -> None:
    """Five copies of one row on one side cover one row of the other, not five."""
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", per_token([5, 6]), token_ids=[5, 6], request="r")
    with td.record(tmp_path / "b.h5") as rec:
        copies = np.repeat(per_token([5])[None], 5, axis=0)  # [5 requests, 1 token, H]
        rec.log("h", copies, token_ids=[[5]] * 5, request=[f"q{i}" for i in range(5)])
    h = tensor(td.compare(tmp_path / "a.h5", tmp_path / "b.h5"), "h").coverage
    assert (h.aligned, h.compared_a, h.compared_b, h.fraction) == (5, 1, 5, 0.5)


def test_thue_morse_texts_never_share_a_prefix_id(tmp_path) -> None:
    """A polynomial hash modulo 2**64 gives a Thue-Morse string and its complement the same value
    for any odd base: two different texts would align. Prefix ids are taken modulo a prime."""
    bits = np.array([bin(i).count("1") % 2 for i in range(1024)])
    for name, text in (("a", np.where(bits, 20, 10)), ("b", np.where(bits, 10, 20))):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.request_tokens("r", text)
            rec.log("h", rows(1), token_ids=text[-1:], positions=[1023], request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "incomparable" and tensor(report, "h").coverage.aligned == 0


def test_texts_sharing_only_their_first_token_compare_that_row(tmp_path) -> None:
    x = rows(3)
    for name, tokens, shift in (("a", [5, 6, 7], 0), ("b", [5, 9, 7], 1)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("h", x + shift, token_ids=tokens, request=name)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged" and tensor(report, "h").coverage.aligned == 1


def test_step_alignment_leaves_out_rows_whose_own_tokens_differ(tmp_path) -> None:
    for name, tokens in (("a", [5, 6, 7]), ("b", [8, 9, 10])):
        with td.record(tmp_path / f"{name}.h5") as rec:  # positions from 1: no prefix is known
            rec.log("h", rows(3), token_ids=tokens, positions=[1, 2, 3], request=name)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", align="step")
    assert report.verdict == "incomparable"
    assert tensor(report, "h").coverage.skipped_b == {"outside_shared_prefix": 3}


def test_a_nan_row_is_the_worst_value(tmp_path) -> None:
    x = rows(4)
    y = x.copy()
    y[1, 2] = np.nan
    for name, data in (("a", x), ("b", y)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("h", data, token_ids=np.arange(4))
    worst = tensor(td.compare(tmp_path / "a.h5", tmp_path / "b.h5"), "h").worst
    assert np.isnan(worst["max_rel"]) and np.isnan(worst["cosine"])


def test_a_report_of_another_version_is_refused(tmp_path) -> None:
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", rows(2), token_ids=[1, 2])
    text = td.compare(tmp_path / "a.h5", tmp_path / "a.h5").to_json()
    later = REPORT_VERSION + 1
    with pytest.raises(ValueError, match=f"report version {later}"):
        Report.from_json(text.replace(f'"report_version": {REPORT_VERSION}', f'"report_version": {later}'))


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_closed_pipe_keeps_the_verdicts_exit_code(tmp_path) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO

    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", rows(40), token_ids=np.arange(40))
    code = "from tracediff.cli import main; main()"
    for args, expected in (([], 0), (["--json"], 0), (["--markdown"], 0)):
        trace = str(tmp_path / "a.h5")
        proc = subprocess.Popen([sys.executable, "-c", code, "compare", trace, trace, *args],
                                stdout=subprocess.PIPE, env={"PYTHONPATH": str(REPO)})
        proc.stdout.read(10)
        proc.stdout.close()  # the reader leaves, as `| head -c 10` does
        assert proc.wait(60) == expected, args


def test_two_vocab_ids_never_share_a_prefix_id(tmp_path) -> None:
    """68248 and 83861 scramble to the same residue modulo 2**31 - 1: a prefix hash built on that
    alone took two different texts for one."""
    for name, second in (("a", 68248), ("b", 83861)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("h", rows(4), token_ids=[5, second, 7, 9], request=name)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged" and report.token_mismatch is not None  # one text, one token edited
    assert report.text_edit.tokens_a == [68248] and report.text_edit.tokens_b == [83861]
    assert tensor(report, "h").coverage.aligned == 1


def test_draft_chains_past_the_other_sides_text_are_excused_not_held_against_coverage(tmp_path) -> None:
    """Serving drafts a chain after its last token; a training sample of the same text stops there
    (it cannot feed a token it does not have). Such chain rows say nothing against coverage. But
    where the other side's text goes on, a chain row it did not record still counts."""
    text = [5, 6, 7, 8]
    chain = {0: 6, 1: 7, 2: 8}  # anchor t at depth 1 is fed x[t + 2] when teacher-forced
    h = {(t, d): rows(1, seed=10 * t + d) for t in range(3) for d in range(2)}

    def write(path, anchors, fed, known) -> None:
        with td.record(path) as rec:
            rec.request_tokens("r", known)
            for t in range(3):  # depth 0: row t fed x[t + 1]
                keys = dict(token_ids=[text[t]], positions=[t], request="r")
                rec.log("draft.input_ids", np.array([text[t + 1]]), **keys)
                rec.log("draft.hidden", h[t, 0], **keys)
            for t in anchors:
                keys = dict(token_ids=[text[t]], positions=[t], request="r", depth=1)
                rec.log("draft.input_ids", np.array([fed(t)]), **keys)
                rec.log("draft.hidden", h[t, 1], **keys)

    write(tmp_path / "train.h5", [0, 1], lambda t: chain[t], text)  # anchor 2 would need x[4]
    write(tmp_path / "serve.h5", [1, 2], lambda t: chain.get(t, 9), text)  # anchor 2 fed its own guess
    report = td.compare(tmp_path / "train.h5", tmp_path / "serve.h5", min_coverage=1.0)
    hidden = tensor(report, "draft.hidden").coverage
    assert report.verdict == "match" and hidden.aligned == 4
    assert hidden.skipped_b == {"past_other_text": 1} and hidden.fraction == 1.0
    write(tmp_path / "longer.h5", [0, 1], lambda t: chain[t], [*text, 3])  # knows x[4], drafted no row there
    report = td.compare(tmp_path / "longer.h5", tmp_path / "serve.h5", min_coverage=1.0)
    assert tensor(report, "draft.hidden").coverage.skipped_b == {"not_recorded": 1}
    assert report.verdict == "incomplete"


@pytest.mark.parametrize("keys, said", [("step_position", "its rows"), ("mixed", "some of its rows"),
                                        ("tokens", None)])
def test_the_report_says_when_a_sides_rows_are_keyed_by_step_and_position_only(tmp_path, keys, said) -> None:
    from tracediff.report.compare import to_markdown, trace_notes

    for side in ("a", "b"):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log("h", rows(2), token_ids=[1, 2])
            if side == "b":
                rec.update_contract(row_keys=keys)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.b.row_keys == keys and report.a.row_keys == ""
    notes = [n for n in trace_notes(report) if "keyed by step and position" in n]
    if said is None:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith(f"note: b ({tmp_path / 'b.h5'}): {said} carry no")
        assert "keyed by step and position" in to_markdown(report)


def test_a_name_both_static_and_per_token_on_one_side_is_said_so(tmp_path) -> None:
    for side in ("a", "b"):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log("h", rows(2), token_ids=[1, 2])
            if side == "a":
                rec.log_static("h", rows(1)[0])
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    (h,) = report.tensors
    assert (report.verdict, h.status) == ("incomplete", "mixed_records")
    assert h.note == "a: static and per-token records"
    assert h.coverage is not None and "static and per-token" in h.coverage.describe()
