"""`tracediff import sglang-dump`: files written by SGLang's REAL dumper (its own API, in-process,
on real tensors of a tiny Llama) become a serving trace under canonical names, keyed by the tokens
the dump carries, comparable with a trace of the same tokens; bad input is one line and no trace."""

from __future__ import annotations

import pytest

from tracediff.integrations.sglang_cpu import sglang_missing

REASON = sglang_missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import run_cli, tiny_llama  # noqa: E402
from tracediff.integrations.sglang_dump import import_sglang_dump, is_draft_step  # noqa: E402

PROMPTS = {"req-a": [5, 77, 300, 12, 9], "req-b": [17, 3, 250]}
E = "non_intrusive__model.embed_tokens.output"
LOGITS = "non_intrusive__logits_processor.output.next_token_logits"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=2)


@pytest.fixture(scope="module")
def sgl_dumper():
    from tracediff.integrations.sglang_cpu import prepare

    prepare()
    from sglang.srt.debug_utils.dumper import dumper

    yield dumper
    dumper.reset()
    dumper.configure(enable=False)


@pytest.fixture
def dumper(sgl_dumper, tmp_path):
    """SGLang's dumper writing to tmp_path/dumps/<its run name>, as DUMPER_ENABLE=1 DUMPER_DIR=... does."""
    sgl_dumper.reset()
    # a named run: the default name is agreed across ranks with a collective, which fails on a CPU
    # once another test has started a process group
    sgl_dumper.configure(enable=True, dir=str(tmp_path / "dumps"), exp_name="run0",
                         enable_output_console=False, non_intrusive_mode="all")
    return sgl_dumper


def forward(model, tokens: list[int]):
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states, out.logits[0]


def test_non_intrusive_dumps_of_a_model_forward_import_under_canonical_names(dumper, model, tmp_path) -> None:
    tokens = PROMPTS["req-a"]
    dumper.register_non_intrusive_dumper(model)
    with torch.no_grad():  # the hooks dump the root's input_ids / position_ids as core fields
        model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None])
    dumper.step()
    dumper.reset()
    hidden, logits = forward(model, tokens)
    out = tmp_path / "serve.h5"
    done = run_cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: ") and "align only by step" not in done.stdout
    with td.open_trace(out) as trace:
        names = trace.names()
        assert {"target.embed", "target.final_hidden", "target.logits"} <= set(names)
        assert "sglang.non_intrusive__model.layers.0.output" in names  # SGLang's: the last branch only
        assert not {"sglang.input_ids", "sglang.position_ids"} & set(names)  # keys, not records
        embed = trace.rows("target.embed")
        assert torch.equal(torch.from_numpy(embed.numpy()), hidden[0][0])
        assert torch.equal(torch.from_numpy(trace.rows("target.final_hidden").numpy()), hidden[-1][0])
        assert torch.equal(torch.from_numpy(trace.rows("target.logits").numpy()), logits)
        assert embed.position.tolist() == list(range(5)) and embed.token_id.tolist() == tokens
        assert trace.meta["contract"]["imported_from"] == "sglang-dump"
        assert trace.finals[0]["contract"]["row_keys"] == "tokens"


def sglang_step(dumper, rids, input_ids, positions, seq_lens, tensors: dict) -> None:
    """One SGLang forward as its dumper writes it: the ForwardBatch core fields, then module tensors."""
    dumper.dump("input_ids", torch.tensor(input_ids))
    dumper.dump("seq_lens", torch.tensor(seq_lens))
    dumper.dump("positions", torch.tensor(positions))
    dumper.dump("rids", list(rids))
    for name, value in tensors.items():
        dumper.dump(name, value)
    dumper.step()


def test_a_served_batch_aligns_by_tokens_with_a_reference_trace_and_draft_rows_take_target_keys(
        dumper, model, tmp_path) -> None:
    rids = list(PROMPTS)
    runs = {rid: forward(model, tokens) for rid, tokens in PROMPTS.items()}
    new = {rid: int(runs[rid][1][-1].argmax()) for rid in rids}
    flat = [t for rid in rids for t in PROMPTS[rid]]
    positions = [p for rid in rids for p in range(len(PROMPTS[rid]))]
    lens = [len(PROMPTS[rid]) for rid in rids]
    # prefill: flat tokens of both requests; logits only at each request's last token
    sglang_step(dumper, rids, flat, positions, lens, {
        E: torch.cat([runs[rid][0][0][0] for rid in rids]),
        LOGITS: torch.stack([runs[rid][1][-1] for rid in rids])})
    # the draft's extend: ids shifted left by one (row t embeds token t+1), fc over 3 aux states
    fed = [t for rid in rids for t in [*PROMPTS[rid][1:], new[rid]]]
    aux = torch.cat([torch.cat([runs[rid][0][i][0] for i in range(3)], -1) for rid in rids])
    sglang_step(dumper, rids, fed, positions, lens, {
        "non_intrusive__model.fc.inputs.0": aux, E: model.model.embed_tokens(torch.tensor(fed)).detach()})
    # decode: one token per request at the next position
    longer = {rid: forward(model, [*PROMPTS[rid], new[rid]]) for rid in rids}
    sglang_step(dumper, rids, [new[r] for r in rids], lens, [n + 1 for n in lens], {
        E: torch.stack([longer[rid][0][0][0, -1] for rid in rids]),
        LOGITS: torch.stack([longer[rid][1][-1] for rid in rids])})

    done = import_sglang_dump(tmp_path / "dumps", tmp_path / "serve.h5")
    assert (done.steps, done.steps_without_tokens, done.skipped) == (3, 0, 0)
    with td.record(tmp_path / "reference.h5", source="reference") as rec:  # the same tokens, run by HF
        for i, rid in enumerate(rids):
            tokens = [*PROMPTS[rid], new[rid]]
            hidden, logits = longer[rid]
            rec.log("target.embed", hidden[0][0], request=f"hf{i}", token_ids=tokens)
            last = [len(tokens) - 2, len(tokens) - 1]
            rec.log("target.logits", logits[last], request=f"hf{i}", token_ids=[tokens[p] for p in last],
                    positions=last)
    report = td.compare(tmp_path / "reference.h5", tmp_path / "serve.h5", tol=["target.*:max_abs<=1e-5"])
    checked = {t.name: t for t in report.tensors}
    assert checked["target.embed"].rows == sum(lens) + 2 and checked["target.logits"].rows == 4
    assert all(checked[n].coverage.fraction == 1.0 for n in ("target.embed", "target.logits"))
    with td.open_trace(tmp_path / "serve.h5") as trace:
        assert trace.finals[0]["token_conflicts"] == 0
        fc = trace.rows("draft.fc_in")  # row t: aux(t), keyed by the target's token x[t]
        assert fc.token_id.tolist() == flat and list(fc.request) == ["req-a"] * 5 + ["req-b"] * 3
        assert torch.equal(torch.from_numpy(fc.numpy()), aux)
        assert trace.rows("draft.input_ids").numpy().tolist() == fed
        assert trace.request_tokens().sequence("req-b")[1].tolist() == [*PROMPTS["req-b"], new["req-b"]]
    assert report.verdict == "match", report.reasons


def test_dumps_without_tokens_say_rows_align_only_by_step_and_position(dumper, tmp_path) -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    dumper.dump("custom_hidden", x, layer_id=1)
    dumper.step()
    out = tmp_path / "serve.arrow"
    done = run_cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "1 of 1 steps carry no input_ids: their rows align only by step and position" in done.stdout
    with td.open_trace(out) as trace:
        rows = trace.rows("sglang.custom_hidden")
        assert torch.equal(torch.from_numpy(rows.numpy()), x) and rows.position.tolist() == [0, 1, 2, 3]
        assert trace.finals[0]["contract"]["row_keys"] == "step_position"


def test_draft_steps_are_told_by_their_modules() -> None:
    target = {E, "non_intrusive__model.layers.0.output", "non_intrusive__model.layers.1.output"}
    assert not is_draft_step(target)
    assert is_draft_step({E, "non_intrusive__model.fc.output", "non_intrusive__model.layers.0.output"})
    assert is_draft_step({E, "non_intrusive__model.layers.0.mlp.output"})  # depth >= 1 runs no fc


class Payload:
    """Not a tensor: loading it would need real unpickling."""


def test_bad_dumps_are_one_line_and_leave_no_trace(dumper, tmp_path) -> None:
    dumper.dump("input_ids", torch.tensor([1, 2, 3]))
    dumper.dump("custom", torch.ones(3, 2))
    dumper.step()
    run = next((tmp_path / "dumps").iterdir())
    good = sorted(run.iterdir())[-1]
    out = tmp_path / "serve.h5"
    meta = torch.load(good, weights_only=True)["meta"]

    def case(name: str, write) -> str:
        folder = tmp_path / name
        folder.mkdir()
        write(folder / good.name)
        with pytest.raises(td.InputError) as caught:
            import_sglang_dump(folder, out)
        assert not out.exists()
        return caught.value.problem

    assert "which would need unpickling" in case("pickled", lambda p: torch.save(
        {"value": Payload(), "meta": meta}, p))
    cut = good.read_bytes()[:200]
    assert "truncated, or not a torch.save file" in case("truncated", lambda p: p.write_bytes(cut))
    assert "a dict with 'value' and 'meta'" in case("foreign", lambda p: torch.save(torch.ones(2), p))
    assert "no SGLang dumper files" in case("empty", lambda p: None)

    def two_runs(path) -> None:
        path.write_bytes(good.read_bytes())
        (path.parent / "other").mkdir()
        (path.parent / "other" / good.name).write_bytes(good.read_bytes())

    assert "the dumps of 2 runs" in case("two", two_runs)
    missing = run_cli("import", "sglang-dump", str(tmp_path / "nowhere"), "-o", str(out))
    assert missing.returncode == 2 and missing.stderr == f"error: {tmp_path / 'nowhere'}: no such directory\n"
    out.write_bytes(b"precious")
    exists = run_cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(out))
    assert exists.returncode == 2 and exists.stderr.count("\n") == 1 and "already exists" in exists.stderr
    assert out.read_bytes() == b"precious"
