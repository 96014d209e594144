"""explain on traces from SGLang's real serving code (the committed sample's trained target and
draft through ``draft_forward`` on CPU, 7 steps, topk 1, chat prompts sharing a system prefix):
an aux-layer bug is the fc input's, a draft exported without d2t the vocab map's, and a second
checkpoint with another rope_theta the draft computation's, each with its cost."""

from __future__ import annotations

import json

import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import tracediff as td  # noqa: E402
from testbed.sglang_cpu import ServedSample, serve_sample  # noqa: E402
from tests.conftest import cli  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding  # noqa: E402
from tracediff.eagle3.explain import Explanation, explain  # noqa: E402
from tracediff.eagle3.readings import READINGS, SGLANG  # noqa: E402

pytestmark = pytest.mark.slow  # each fixture serves four requests through SGLang's real code

SERVED = dict(num_steps=7, requests=4, new_tokens=16)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("healthy"), **SERVED)


def explained(a: ServedSample, b: ServedSample) -> Explanation:
    embed = target_embedding(a.target_dir)
    drafts = {side: load_draft(run.draft_dir, embed, reading=READINGS[SGLANG])
              for side, run in (("a", a), ("b", b))}
    with td.open_trace(a.trace) as ta, td.open_trace(b.trace) as tb:
        return explain(ta, tb, drafts)


@pytest.mark.parametrize(("case", "changes", "group"), [
    ("aux_layers", {"aux_ids": (0, 2, 4)}, "fc input"),  # outputs of layers 0, 2, 4: trained on embed, 1, 3
    ("no_d2t", {"without_d2t": True}, "vocab map (d2t)"),
    ("rope_theta", {"config": {"rope_theta": 10.0}}, "draft computation"),
])
def test_each_bug_is_attributed_to_its_input(healthy, tmp_path, case, changes, group) -> None:
    broken = serve_sample(tmp_path, **SERVED, **changes)
    ex = explained(healthy, broken)
    a, b = ex.run("A's inputs"), ex.run("B's inputs")
    assert a.expected_accept_len - b.expected_accept_len > 0.5 and ex.cost > ex.noise
    said = f"B's {group} costs {ex.cost:.2f} accepted tokens per verify"
    assert ex.conclusion.startswith(said), ex.conclusion
    fixed = ex.run(f"B with A's {group}")
    assert abs(fixed.expected_accept_len - a.expected_accept_len) <= ex.noise
    assert ex.recorded_agreement == {"a": 1.0, "b": 1.0}  # each server ran the checkpoint it was given


def test_two_healthy_servings_have_nothing_to_explain(healthy, tmp_path) -> None:
    again = serve_sample(tmp_path, **{**SERVED, "requests": 2})
    done = cli("explain", str(healthy.trace), str(again.trace), "--draft", str(healthy.draft_dir), "--target",
               str(healthy.target_dir), "--json")
    assert done.returncode == 0, done.stderr
    plain = json.loads(done.stdout)
    assert plain["differing"] == [] and "nothing to explain" in plain["conclusion"]
