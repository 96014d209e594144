"""Targets compared by what defines them (config architecture and sizes, an embedding fingerprint),
not by a name or a path: an HF ``--watch`` trace and an SGLang trace of one tiny model are
comparable; two targets with other weights are incomparable until declared the same
(``same_target`` / ``--same-target``); traces stating names only are compared, the name noted."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from tests.conftest import run_python, tiny_eagle3, tiny_llama  # noqa: E402
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.integrations.target_summary import target_identity  # noqa: E402

PROMPT = [5, 77, 300, 12, 9, 41, 8]


def terminal(report) -> str:
    from rich.console import Console

    from tracediff.report.compare import render

    out = io.StringIO()
    render(Console(file=out, width=400), report)
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_hf_watch_trace_and_an_sglang_trace_of_one_model_are_comparable(tmp_path) -> None:
    from testbed.sglang_cpu import sglang_missing

    if sglang_missing():
        pytest.skip(sglang_missing())
    from testbed.sglang_cpu import CpuServer, tiny_checkpoint

    target_dir, target_weights, draft_dir, draft_weights = tiny_checkpoint(tmp_path)
    torch.save(target_weights, tmp_path / "target.pt")
    serving = tmp_path / "serving.h5"
    with td.record(serving, source="serving") as rec:
        server = CpuServer(target_dir, target_weights, draft_dir, draft_weights, num_steps=2, recorder=rec,
                           served_model_name="nu-tiny-llama")
        server.serve([PROMPT], 6, rids=["r0"])
        server.close()
    program = tmp_path / "host.py"
    program.write_text(
        "import torch, transformers\n"
        f"config = transformers.AutoConfig.from_pretrained({target_dir!r})\n"
        "model = transformers.LlamaForCausalLM(config).eval()\n"
        f"model.load_state_dict(torch.load({str(tmp_path / 'target.pt')!r}))\n"
        "with torch.no_grad():\n"
        f"    model(input_ids=torch.tensor([{PROMPT!r}]))\n")
    watched = tmp_path / "watch.h5"
    done = run_python("from tracediff.cli import main; main()", "record", "--out", str(watched), "--watch",
                      "model.layers.*", "--", sys.executable, str(program), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = td.compare(watched, serving)
    assert report.verdict != "incomparable", report.reasons
    assert not [r for r in report.reasons if "target" in r]
    differing = {e.key: (e.a, e.b) for e in report.contract.differing}
    assert differing["target_model"] == (target_dir, "nu-tiny-llama")
    assert not [k for k in differing if k.startswith("target_config") or k == "target_embedding_sha256"]
    layers = [t for t in report.tensors if t.name.startswith("target.layer.")]
    assert len(layers) == 8 and all(t.status == "match" and t.rows == len(PROMPT) for t in layers)
    assert f'target_model: "{target_dir}" | "nu-tiny-llama" (a name or a path only' in terminal(report)
    with td.open_trace(watched) as a, td.open_trace(serving) as b:
        for key in ("target_config", "target_embedding_sha256"):
            assert a.contract[key] == b.contract[key]
        assert a.contract["target_config"]["architecture"] == "LlamaForCausalLM"
        assert a.contract["target_config"]["num_hidden_layers"] == 8


def serve(target, draft, path) -> None:
    decoder = SpeculativeDecoder(target, draft, Conventions(AuxSpec((1, 2, 3))), num_steps=2)
    with td.record(path, source="serving", meta=decoder.contract()) as rec:
        decoder.rec = rec
        decoder.decode("r0", PROMPT, 6)


@pytest.fixture(scope="module")
def two_targets(tmp_path_factory):
    """The reference loop on the same draft over two targets of one config, other weights."""
    target, draft = tiny_eagle3()
    root = tmp_path_factory.mktemp("targets")
    serve(target, draft, root / "a.h5")
    serve(tiny_llama(seed=1), draft, root / "b.h5")
    return root / "a.h5", root / "b.h5"


def test_other_weights_are_another_target_until_declared_the_same(two_targets) -> None:
    a, b = two_targets
    report = td.compare(a, b)
    assert report.verdict == "incomparable"
    assert report.reasons[0].startswith("different target models: target_embedding_sha256 a '")
    assert "--same-target" in report.reasons[0]
    declared = td.compare(a, b, same_target=True)
    assert declared.verdict == "diverged" and declared.first_divergence.name == "target.embed"
    assert [e.key for e in declared.contract.differing] == ["target_embedding_sha256"]
    assert "(the target itself (declared the same target: --same-target))" in terminal(declared)
    assert json.loads(declared.to_json())["contract"]["differing"][0]["key"] == "target_embedding_sha256"


def test_the_cli_takes_same_target(two_targets) -> None:
    from typer.testing import CliRunner

    from tracediff.cli import app

    a, b = two_targets
    assert CliRunner().invoke(app, ["compare", str(a), str(b)]).exit_code == 2
    assert CliRunner().invoke(app, ["compare", str(a), str(b), "--same-target"]).exit_code == 1


def test_traces_stating_only_names_are_compared_and_the_name_noted(tmp_path) -> None:
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for path, model in (("a.h5", "/models/llama-tiny"), ("b.h5", "llama-tiny-served")):
        with td.record(tmp_path / path, meta={"target_model": model}) as rec:
            rec.log("h", x, token_ids=[5, 6, 7], request="p")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert (report.verdict, report.reasons) == ("match", [])
    assert [e.key for e in report.contract.differing] == ["target_model"]
    assert "(a name or a path only: no target fact the sides both state differs)" in terminal(report)


def test_the_fingerprint_is_the_models_in_any_dtype_and_not_another_models() -> None:
    model = tiny_llama(seed=0)
    facts = target_identity(model)
    assert facts["target_config"] == {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "intermediate_size": 128, "vocab_size": 512,
                                      "architecture": "LlamaForCausalLM"}
    assert target_identity(tiny_llama(seed=0).to(torch.bfloat16)) == facts
    assert target_identity(tiny_llama(seed=1))["target_embedding_sha256"] != facts["target_embedding_sha256"]
    assert target_identity(tiny_llama(seed=0, layers=2))["target_config"]["num_hidden_layers"] == 2
