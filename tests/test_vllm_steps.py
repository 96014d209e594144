"""tracediff/integrations/vllm/steps.py: which rows of a vLLM step hold the request's text, and their keys.

One request with prompt x[0..7] = 10..17, three drafts per step (k = 3), as vLLM 0.32 runs it: a
prefill step, then verify steps feeding [bonus, d0, d1, d2]; the draft's first pass runs over the
same rows fed the tokens shifted by one; its sample row per request is the chain's anchor.
"""

from __future__ import annotations

import numpy as np

from tracediff.integrations.vllm.steps import (
    ANCHOR,
    DRAFT0,
    LOGITS,
    TARGET,
    VERIFY,
    ClientText,
    StepRows,
    anchors_of,
    client_text,
)

PROMPT = list(range(10, 18))


def test_prefill_rows_are_keyed_by_the_prompt_and_the_first_pass_by_the_next_token() -> None:
    text = {"r": np.array(PROMPT + [50], dtype=np.int64)}  # 50: the token the prefill sampled
    rows = StepRows(["r"], np.array([0, 8]), np.arange(8), np.array(PROMPT), logits_rows=np.array([7]),
                    draft_position=np.arange(8), draft_fed=np.array(PROMPT[1:] + [50]), anchors=np.array([7]))
    keys = rows.resolve(text, {})
    assert keys[TARGET].index.tolist() == list(range(8))
    assert keys[TARGET].token.tolist() == PROMPT
    assert keys[LOGITS].index.tolist() == [0] and keys[LOGITS].position.tolist() == [7]
    assert keys[DRAFT0].index.tolist() == list(range(8))  # every row was fed x[p + 1]
    assert (keys[ANCHOR].position.tolist(), keys[ANCHOR].token.tolist()) == ([7], [17])
    assert anchors_of(keys[ANCHOR], ["r"]) == {"r": (7, 17)}
    assert not len(keys[VERIFY].index)  # nothing verified yet


def test_a_verify_keeps_the_bonus_and_the_accepted_drafts_and_keys_the_outcome_at_the_last_anchor() -> None:
    # step 2 feeds [50 (bonus), 51, 52, 99] at 8..11: d0, d1 accepted, d2 rejected; the correction is 53
    text = {"r": np.array(PROMPT + [50, 51, 52, 53], dtype=np.int64)}
    rows = StepRows(["r"], np.array([0, 4]), np.arange(8, 12), np.array([50, 51, 52, 99]),
                    logits_rows=np.arange(4), draft_position=np.arange(8, 12),
                    draft_fed=np.array([51, 52, 53, 7]), anchors=np.array([2]), accepted={"r": 2})
    keys = rows.resolve(text, {"r": (7, 17)})
    assert keys[TARGET].index.tolist() == [0, 1, 2]  # the row fed the rejected draft is not text
    assert keys[TARGET].position.tolist() == [8, 9, 10]
    assert keys[LOGITS].index.tolist() == [0, 1, 2]
    assert keys[DRAFT0].index.tolist() == [0, 1, 2]  # row 10 fed the correction 53 = x[11]
    assert (keys[ANCHOR].position.tolist(), keys[ANCHOR].token.tolist()) == ([10], [52])
    assert (keys[VERIFY].position.tolist(), keys[VERIFY].token.tolist()) == ([7], [17])


def test_rows_of_a_request_not_recorded_or_past_its_text_are_left_out() -> None:
    text = {"a": np.array([1, 2, 3], dtype=np.int64)}  # "b" is filtered out (no text)
    rows = StepRows(["a", "b"], np.array([0, 3, 5]), np.array([0, 1, 2, 0, 1]), np.array([1, 2, 3, 7, 8]),
                    logits_rows=np.array([2, 4]), draft_position=np.array([0, 1, 2, 0, 1]),
                    draft_fed=np.array([2, 3, 4, 8, 9]), anchors=np.array([2, 4]))
    keys = rows.resolve(text, {})
    assert keys[TARGET].request.tolist() == ["a", "a", "a"]
    assert keys[LOGITS].index.tolist() == [0]
    assert keys[DRAFT0].index.tolist() == [0, 1]  # x[3] of "a" is not known yet
    assert not len(keys[ANCHOR].index)


def test_a_first_pass_over_other_rows_is_not_keyed() -> None:
    rows = StepRows(["r"], np.array([0, 2]), np.array([0, 1]), np.array([10, 11]),
                    draft_position=np.array([1]), draft_fed=np.array([12]), anchors=np.array([0]))
    keys = rows.resolve({"r": np.array([10, 11, 12])}, {})
    assert DRAFT0 not in keys and ANCHOR not in keys and TARGET in keys


def test_client_text_ends_where_vllms_scheduler_stops_the_request() -> None:
    prompt = [1, 2]
    assert client_text(prompt, [5, 6, 7, 8], max_tokens=3, eos=None, stop_ids=None,
                       max_model_len=None).tolist() == [1, 2, 5, 6, 7]
    assert client_text(prompt, [5, 2, 7], max_tokens=10, eos=2, stop_ids=None,
                       max_model_len=None).tolist() == [1, 2, 5, 2]  # EOS kept, what follows dropped
    assert client_text(prompt, [5, 6, 7], max_tokens=10, eos=None, stop_ids=[6],
                       max_model_len=None).tolist() == [1, 2, 5, 6]
    assert client_text(prompt, [5, 6, 7], max_tokens=10, eos=None, stop_ids=None,
                       max_model_len=3).tolist() == [1, 2, 5]


def test_client_text_grown_step_by_step_equals_the_text_read_at_once() -> None:
    output: list[int] = []
    text = ClientText([1, 2], max_tokens=10, eos=9, stop_ids=None, max_model_len=None)
    grown = []
    for accepted in ([5], [6, 7, 8], [], [9, 4, 4]):  # a verify accepts several; the worker runs past EOS
        output.extend(accepted)
        grown.append(text.extend(output).tolist())
    assert grown[-1] == client_text([1, 2], output, max_tokens=10, eos=9, stop_ids=None,
                                    max_model_len=None).tolist() == [1, 2, 5, 6, 7, 8, 9]
    assert grown[:3] == [[1, 2, 5], [1, 2, 5, 6, 7, 8], [1, 2, 5, 6, 7, 8]]
