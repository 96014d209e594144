"""The token table (format version 2): declared and learned tokens, what is written at each flush,
how readers see it (and never as a tensor), across formats, ranks and version 1 traces."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO, cli
from tracediff.trace.convert import convert
from tracediff.trace.reader import MixedRecords, TokenTable

VERSION_1 = REPO / "tests" / "data" / "format_v1_serving.h5"  # the sample serving trace, as format 1 wrote it


def table_of(path) -> dict[str, dict[int, int]]:
    """The token table as {request: {position: token}}, checking it has one entry per key."""
    with td.open_trace(path) as trace:
        table = trace.request_tokens()
    assert isinstance(table, TokenTable)
    assert table.request.dtype == object and table.position.dtype == table.token_id.dtype == np.int64
    out: dict[str, dict[int, int]] = {}
    for r, p, t in zip(table.request.tolist(), table.position.tolist(), table.token_id.tolist()):
        assert p not in out.setdefault(r, {}), (r, p)
        out[r][p] = t
    return out


def decode_loop(rec, prompt: list[int], steps: int, request: str = "req") -> list[int]:
    """A toy decode: prefill at step 0, then one new token a step, each logged with its keys."""
    tokens = list(prompt)
    rec.log("target.layer.0", np.zeros((len(prompt), 4), np.float32), step=0, request=request,
            token_ids=np.array(prompt))
    for step in range(1, steps + 1):
        tokens.append(1000 + step)
        rec.log("target.layer.0", np.full((1, 4), step, np.float32), step=step, request=request,
                token_ids=np.array(tokens[-1:]), positions=np.array([len(tokens) - 1]))
    return tokens


def test_every_nth_step_still_knows_every_decoded_token(tmp_path, fmt) -> None:
    path = tmp_path / f"every.{fmt}"
    with td.record(path, every=3) as rec:
        tokens = decode_loop(rec, [5, 6, 7], steps=10)
    with td.open_trace(path) as trace:
        assert sorted(set(trace.index.step.tolist())) == [0, 3, 6, 9]  # only every 3rd step recorded
        assert trace.meta["format_version"] >= 2
        assert trace.finals[0]["token_conflicts"] == 0 and trace.finals[0]["tokens"] == len(tokens)
    assert table_of(path) == {"req": dict(enumerate(tokens))}


def test_name_and_request_filters_still_teach_tokens(tmp_path, fmt) -> None:
    path = tmp_path / f"names.{fmt}"
    with td.record(path, names="draft.*", requests={"kept"}) as rec:
        rec.log("target.embed", np.zeros((2, 3, 4), np.float32), token_ids=np.array([[1, 2, 3], [4, 5, 6]]),
                request=["kept", "other"])
        rec.log("draft.fc_in", np.zeros((2, 1, 4), np.float32), token_ids=np.array([[7], [8]]),
                positions=np.array([[3], [3]]), request=["kept", "other"])
    with td.open_trace(path) as trace:
        assert trace.names() == ["draft.fc_in"] and trace.rows("draft.fc_in").request.tolist() == ["kept"]
    assert table_of(path) == {"kept": {0: 1, 1: 2, 2: 3, 3: 7}, "other": {0: 4, 1: 5, 2: 6, 3: 8}}


def test_declared_tokens_in_pieces_and_conflicts_counted(tmp_path, fmt) -> None:
    path = tmp_path / f"declared.{fmt}"
    with td.record(path) as rec:
        rec.request_tokens("a", [10, 11, 12])
        rec.request_tokens("a", np.array([13, 14]), start=3)
        rec.request_tokens("b", [20])
        rec.log("h", np.zeros((2, 2), np.float32), token_ids=np.array([12, 99]), positions=np.array([2, 3]),
                request="a")  # position 3 disagrees with the declared 13: first seen wins, counted
    assert table_of(path) == {"a": {0: 10, 1: 11, 2: 12, 3: 13, 4: 14}, "b": {0: 20}}
    with td.open_trace(path) as trace:
        assert trace.finals[0]["token_conflicts"] == 1
        assert trace.request_tokens().requests() == ["a", "b"]
        positions, tokens = trace.request_tokens().sequence("a")
        assert positions.tolist() == [0, 1, 2, 3, 4] and tokens.tolist() == [10, 11, 12, 13, 14]


def test_each_flush_writes_only_new_entries(tmp_path, fmt) -> None:
    path = tmp_path / f"flush.{fmt}"
    ids = np.arange(8)
    with td.record(path) as rec:
        for step in range(3):
            rec.log("h", np.zeros((8, 2), np.float32), step=step, token_ids=ids, request="r")
            assert rec.flush()
        rec.log("h", np.zeros((9, 2), np.float32), step=3, token_ids=np.arange(9), request="r")
    with td.open_trace(path) as trace:
        file = trace.files[0]
        assert len(file.token_slots) == 2  # the first flush, and the one that brought position 8
        request, position, token = trace.token_keys(0)
        assert position.tolist() == list(range(9)) and token.tolist() == list(range(9))


def test_hooks_of_one_forward_learn_their_keys_once(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from tests.conftest import tiny_llama

    model = tiny_llama(layers=2)
    path = tmp_path / "hooks.h5"
    with td.record(path, names="target.layer.1") as rec:
        rec.watch_modules(model, "model.layers.*", "target.layer.{*}")
        rec.watch(model.lm_head, "target.logits")
        queued = []
        learn = rec._learn
        rec._learn = lambda keys, seen, declared=False: (queued.append(keys), learn(keys, seen, declared))
        with torch.no_grad():
            for step in range(2):
                ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(step))
                with rec.context(step=step, token_ids=ids, request=[f"r{step}a", f"r{step}b"]):
                    model(ids)
    assert len(queued) == 2  # 3 hooks a forward, one learning each
    table = table_of(path)
    assert sorted(table) == ["r0a", "r0b", "r1a", "r1b"] and all(len(v) == 5 for v in table.values())


def test_reserved_records_are_never_tensors(tmp_path, fmt) -> None:
    path = tmp_path / f"reserved.{fmt}"
    with td.record(path) as rec:
        rec.log("h", np.ones((3, 2), np.float32), token_ids=np.arange(3), request="r")
        rec.log_static("w", np.arange(4))
    with td.open_trace(path) as trace:
        assert trace.names() == ["h", "w"]
        assert not any(n.startswith("__") for n in trace.index.name.tolist())
        assert len(trace.select()) == 2 and len(trace.files[0].token_slots) == 1
        assert trace.keys("h").position.tolist() == [0, 1, 2]
    shown = cli("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "__tokens__" not in shown.stdout and "token table: 3 tokens of 1 requests" in shown.stdout
    data = json.loads(cli("show", str(path), "--json").stdout)
    assert [t["name"] for t in data["tensors"]] == ["h", "w"]
    assert (data["tokens"], data["token_requests"]) == (3, 1)


def test_version_1_traces_open_with_an_empty_table() -> None:
    path = VERSION_1
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == 1
    with td.open_trace(path) as trace:
        table = trace.request_tokens()
        assert len(table) == 0 and table.request.dtype == object and table.position.dtype == np.int64
        assert "target.token" in trace.names() and not any(n.startswith("__") for n in trace.names())


def test_rank_files_first_seen_wins(tmp_path, fmt) -> None:
    for rank in (0, 1):
        with td.record(tmp_path / f"t.{fmt}", rank=rank, world_size=2) as rec:
            rec.request_tokens("shared", [1, 2, 3 + rank])  # rank 1 disagrees at position 2
            rec.request_tokens(f"only{rank}", [rank])
    assert table_of(tmp_path / f"t.{fmt}") == {"shared": {0: 1, 1: 2, 2: 3}, "only0": {0: 0}, "only1": {0: 1}}


def test_convert_carries_the_table_h5_arrow_h5(tmp_path) -> None:
    with td.record(tmp_path / "a.h5") as rec:
        tokens = decode_loop(rec, [1, 2], steps=3)
        rec.request_tokens("declared", [7, 8, 9])
    convert(tmp_path / "a.h5", tmp_path / "b.arrow")
    convert(tmp_path / "b.arrow", tmp_path / "c.h5")
    expect = {"req": dict(enumerate(tokens)), "declared": {0: 7, 1: 8, 2: 9}}
    for name in ("a.h5", "b.arrow", "c.h5"):
        assert table_of(tmp_path / name) == expect, name
        with td.open_trace(tmp_path / name) as trace:
            assert trace.names() == ["target.layer.0"] and trace.meta["format_version"] >= 2


def test_keys_of_a_name_with_mixed_records_raise_mixed_records(tmp_path, fmt) -> None:
    path = tmp_path / f"mixed.{fmt}"
    with td.record(path) as rec:  # not strict: the recorder takes it
        rec.log("h", np.zeros((2, 3), np.float32), step=0, token_ids=np.arange(2))
        rec.log("h", np.zeros((2, 3), np.float16), step=1, token_ids=np.arange(2))
        rec.log("g", np.zeros((2, 3), np.float32), step=0, token_ids=np.arange(2))
        rec.log("g", np.zeros((2, 5), np.float32), step=1, token_ids=np.arange(2))
    with td.open_trace(path) as trace:
        assert trace.finals[0]["mixed_records"] == ["g", "h"]
        with pytest.raises(MixedRecords) as caught:
            trace.keys("h")
        assert caught.value.name == "h" and caught.value.dtypes == ["float16", "float32"]
        assert caught.value.row_shapes == [(3,)] and isinstance(caught.value, ValueError)
        with pytest.raises(MixedRecords) as caught:
            trace.keys("g")
        assert caught.value.dtypes == ["float32"] and caught.value.row_shapes == [(3,), (5,)]
        assert trace.keys("h", step=1).dtype == "float16"  # one step alone is one tensor


def format_examples() -> dict[str, str]:
    """The python blocks of docs/FORMAT.md, by the library they show."""
    text = (REPO / "docs" / "FORMAT.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return {lib: next(b for b in blocks if f"import {lib}" in b) for lib in ("numpy", "duckdb")}


@pytest.mark.subprocess
def test_format_md_examples_run_on_a_recorded_bfloat16_trace(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("duckdb")
    layer = torch.randn(4, 6).to(torch.bfloat16)
    with td.record(tmp_path / "trace.arrow") as rec:
        rec.request_tokens("r0", [5, 6, 7, 8, 9])
        rec.log("target.layer.1", layer, step=0, request="r0", token_ids=np.array([5, 6, 7, 8]))
        rec.log("target.logits", torch.zeros(4, 3), step=0, request="r0", token_ids=np.array([5, 6, 7, 8]))
        rec.log("target.layer.1", layer, step=1, request="r0", token_ids=np.array([5, 6, 7, 8]))
    examples = format_examples()
    script = ("import json, numpy as np\n" + examples["numpy"] + examples["duckdb"]
              + "print(json.dumps({'x': x.tolist(), 'dtype': str(x.dtype), 'tensors': tensors, "
                "'tokens': tokens}))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["dtype"] == "float32" and out["x"] == layer.float().tolist()
    assert out["tensors"] == [["target.layer.1", "bfloat16", 2, 8], ["target.logits", "float32", 1, 4]]
    assert out["tokens"] == [["r0", p, 5 + p] for p in range(5)]


def test_format_md_documents_version_2(tmp_path) -> None:
    text = Path(REPO / "docs" / "FORMAT.md").read_text()
    for needed in ("# The tracediff trace format, version", "`__tokens__`", "position -1 = padding row",
                   "version 1 reader", "token_conflicts"):
        assert needed.lower() in text.lower(), needed


KILLED = """
import os, sys
import numpy as np
import tracediff as td
rec = td.record(sys.argv[1], every=5)
for step in range(20):
    rec.log("h", np.zeros((1, 2), np.float32), step=step, request="r", token_ids=np.array([step]),
            positions=np.array([step]))
rec.request_tokens("r", [100], start=20)
assert rec.flush()
os._exit(0)  # no close: no final metadata, no Arrow footer or index
"""


@pytest.mark.subprocess
def test_a_killed_writer_leaves_its_table_up_to_the_last_flush(tmp_path, fmt) -> None:
    from tests.conftest import run_python

    path = tmp_path / f"killed.{fmt}"
    done = run_python(KILLED, str(path))
    assert done.returncode == 0, done.stderr
    with td.open_trace(path) as trace:
        assert not trace.complete and trace.names() == ["h"] and trace.index.step.tolist() == [0, 5, 10, 15]
    assert table_of(path) == {"r": {**{p: p for p in range(20)}, 20: 100}}


def test_a_converted_version_1_trace_is_version_2_without_a_table(tmp_path) -> None:
    convert(VERSION_1, tmp_path / "serving.arrow")
    with td.open_trace(VERSION_1) as old, \
            td.open_trace(tmp_path / "serving.arrow") as new:
        assert new.meta["format_version"] == new.files[0].version == td.trace.FORMAT_VERSION
        assert {k: v for k, v in new.meta.items() if k != "format_version"} == \
            {k: v for k, v in old.meta.items() if k != "format_version"}
        assert new.names() == old.names() and len(new.request_tokens()) == 0
