"""`tracediff import sglang-dump`: files written by SGLang's REAL dumper (its own API, in-process,
on real tensors of a tiny Llama) become a serving trace under canonical names, keyed by the tokens
the dump carries, comparable with a trace of the same tokens; bad input is one line and no trace."""

from __future__ import annotations

import re

import pytest

from testbed.sglang_cpu import sglang_missing

REASON = sglang_missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""),
              pytest.mark.slow]  # SGLang's import and set-up: ~10 s
torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import cli, tiny_llama  # noqa: E402
from tracediff.integrations.sglang.importer import import_sglang_dump, is_draft_step  # noqa: E402

PROMPTS = {"req-a": [5, 77, 300, 12, 9], "req-b": [17, 3, 250]}
E = "non_intrusive__model.embed_tokens.output"
LOGITS = "non_intrusive__logits_processor.output.next_token_logits"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, layers=2)


@pytest.fixture(scope="module")
def sgl_dumper():
    from testbed.sglang_cpu import prepare

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
    done = cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: ") and "align only by step" not in done.stdout
    assert "non-intrusive dumps: module inputs and modules nested in a layer's blocks" in " ".join(
        done.stdout.split())
    with td.open_trace(out) as trace:
        names = trace.names()
        assert {"target.embed", "target.final_hidden", "target.logits"} <= set(names)
        assert not [n for n in names if "non_intrusive" in n]  # grouped names only (docs/INTEGRATIONS.md)
        for i in range(2):  # HF's decoder layer returns its output, but the importer reads SGLang's
            assert f"sglang.layer_output.layer{i}" in names  # models, where it is the last branch only
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
    done = cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "1 of 1 steps carry no input_ids: their rows align only by step and position" in done.stdout
    with td.open_trace(out) as trace:
        rows = trace.rows("sglang.custom_hidden.layer1")  # its layer_id tag
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
    missing = cli("import", "sglang-dump", str(tmp_path / "nowhere"), "-o", str(out))
    assert missing.returncode == 2 and missing.stderr == f"error: {tmp_path / 'nowhere'}: no such directory\n"
    out.write_bytes(b"precious")
    exists = cli("import", "sglang-dump", str(tmp_path / "dumps"), "-o", str(out))
    assert exists.returncode == 2 and exists.stderr.count("\n") == 1
    assert "exists: pass --force to replace it" in exists.stderr
    assert out.read_bytes() == b"precious"


LAYER_DUMP = "layer_start__hidden_states"


def hand_dumped_layers(dumper, model, scale_layer: int | None = None) -> dict:
    """SGLang's documented hand dump: ``dumper.dump(name, hidden_states, layer_id=self.layer_id)`` in
    each of 3 layers of one prefill of both requests (8 tokens); ``scale_layer``'s copy scaled."""
    rids = list(PROMPTS)
    runs = {rid: forward(model, tokens) for rid, tokens in PROMPTS.items()}
    flat = [t for rid in rids for t in PROMPTS[rid]]
    positions = [p for rid in rids for p in range(len(PROMPTS[rid]))]
    lens = [len(PROMPTS[rid]) for rid in rids]
    states = {i: torch.cat([runs[rid][0][i][0] for rid in rids]) for i in range(3)}
    dumper.dump("input_ids", torch.tensor(flat))
    dumper.dump("seq_lens", torch.tensor(lens))
    dumper.dump("positions", torch.tensor(positions))
    dumper.dump("rids", rids)
    for i, state in states.items():
        dumper.dump(LAYER_DUMP, state * (1.5 if i == scale_layer else 1.0), layer_id=i)
    dumper.step()
    return states


def test_one_name_dumped_in_three_layers_is_three_tensors_named_by_layer(dumper, model, tmp_path) -> None:
    states = hand_dumped_layers(dumper, model)
    import_sglang_dump(tmp_path / "dumps", tmp_path / "serve.h5")
    with td.open_trace(tmp_path / "serve.h5") as trace:
        names = set(trace.names())
        assert f"sglang.{LAYER_DUMP}" not in names  # not one tensor of 24 rows
        for i, state in states.items():
            rows = trace.rows(f"sglang.{LAYER_DUMP}.layer{i}")
            assert len(rows) == 8 and torch.equal(torch.from_numpy(rows.numpy()), state)
            assert list(rows.request) == ["req-a"] * 5 + ["req-b"] * 3


def test_a_compare_of_two_dumps_that_differ_in_one_layer_names_that_layer(sgl_dumper, model,
                                                                          tmp_path) -> None:
    for run, scaled in (("a", None), ("b", 1)):
        sgl_dumper.reset()
        sgl_dumper.configure(enable=True, dir=str(tmp_path / run), exp_name="run0",
                             enable_output_console=False, non_intrusive_mode="all")
        hand_dumped_layers(sgl_dumper, model, scale_layer=scaled)
        import_sglang_dump(tmp_path / run, tmp_path / f"{run}.h5")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged"
    assert report.first_divergence is not None
    assert report.first_divergence.name == f"sglang.{LAYER_DUMP}.layer1"
    status = {t.name: t.status for t in report.tensors}
    assert [status[f"sglang.{LAYER_DUMP}.layer{i}"] for i in (0, 2)] == ["match", "match"]


GROUPED = re.compile(r"sglang\.(draft\.)?[a-z_]+(\.(residual|out\d+))?\.layer\d+"
                     r"|sglang\.draft\.norm(\.residual)?")


def test_sglang_models_dumped_by_the_non_intrusive_dumper_map_and_group_as_documented(
        sgl_dumper, tmp_path) -> None:
    """SGLang's own Llama target (4 layers) and EAGLE-3 draft served on CPU, both models under the
    non-intrusive dumper as SGLang's ModelRunner registers it (and steps it after each forward)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from testbed.sglang_cpu import CpuServer, tiny_checkpoint

    target_dir, target_weights, draft_dir, draft_weights = tiny_checkpoint(tmp_path, layers=4,
                                                                                aux_ids=(0, 1, 2))
    server = CpuServer(target_dir, target_weights, draft_dir, draft_weights, num_steps=2)
    sgl_dumper.reset()
    sgl_dumper.configure(enable=True, dir=str(tmp_path / "dumps"), exp_name="run0",
                         enable_output_console=False, non_intrusive_mode="all")
    modules = []
    for module in (server.target, server.draft):
        sgl_dumper.register_non_intrusive_dumper(module)
        forward_fn = module.forward

        def stepping(*args, _forward=forward_fn, **kwargs):
            out = _forward(*args, **kwargs)
            sgl_dumper.step()  # what ModelRunner.forward does after each forward
            return out

        module.forward = stepping
        modules.append((module, forward_fn))
    prompt = PROMPTS["req-a"]
    server.serve([prompt], 2, rids=["req-a"])
    for module, forward_fn in modules:
        module.forward = forward_fn  # the dumper's own wrapper, which its reset removes
    sgl_dumper.reset()
    raw = {torch.load(p, weights_only=True)["meta"]["name"] for p in (tmp_path / "dumps" / "run0").iterdir()}
    done = import_sglang_dump(tmp_path / "dumps", tmp_path / "serve.h5")
    assert done.left_out > 0

    hf = LlamaForCausalLM(LlamaConfig.from_pretrained(target_dir)).eval()
    hf.load_state_dict(target_weights)
    outputs: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(hf.model.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(
            i, (out[0] if isinstance(out, tuple) else out)[0]))
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    with td.open_trace(tmp_path / "serve.h5") as trace:
        names = set(trace.names())
        for i in range(4):  # the residual stream SGLang's fused norms return: each layer's output
            rows = trace.rows(f"target.layer.{i}")
            first = [r for r in range(len(rows)) if rows.step[r] == rows.step[0]]
            assert rows.position[first].tolist() == list(range(5))
            torch.testing.assert_close(torch.from_numpy(rows.numpy()[first]), outputs[i],
                                       atol=1e-5, rtol=1e-5)
        assert {"target.embed", "target.final_hidden", "target.logits", "draft.embed", "draft.fc_in",
                "draft.fc_out", "draft.logits", "draft.input_ids"} <= names
        grouped = names - {n for n in names if n.startswith(("target.", "draft."))}
        assert grouped and all(GROUPED.fullmatch(n) for n in grouped), sorted(grouped)
        blocks = {f"sglang.self_attn.layer{i}" for i in range(4)}
        assert blocks | {"sglang.draft.self_attn.layer0", "sglang.draft.hidden_norm.layer0"} <= grouped
        assert len(names) < len(raw) / 2  # 149 dumper names -> a few per layer
