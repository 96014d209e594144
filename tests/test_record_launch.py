"""`tracediff record -- CMD`: the child runs as it would without us (output, exit code, signals,
its own sitecustomize), `--watch` records a tiny HF Llama under canonical names equal to HF's hidden
states, processes that record nothing write nothing, and bad input is one line before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

import tracediff as td
from tests.conftest import REPO, run_python
from tracediff.cli import app
from tracediff.record import launch
from tracediff.record.launch import LaunchConfig, RequestGate

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY_LLAMA = """
import torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = transformers.LlamaForCausalLM(config).eval()
"""


def host(tmp_path, body: str, head: str = "") -> str:
    """A host program file: what a user runs under `tracediff record`."""
    path = tmp_path / "host.py"
    path.write_text(head + textwrap.dedent(body))
    return str(path)


def record(*args: str, **kw) -> subprocess.CompletedProcess:
    """The real CLI in a fresh interpreter: ``tracediff record ARGS``."""
    return run_python("from tracediff.cli import main; main()", "record", *args, **kw)


def test_watch_records_hf_llama_layers_under_canonical_names_equal_to_hf_hidden_states(tmp_path) -> None:
    program = host(tmp_path, head=TINY_LLAMA, body="""
        prompt = torch.tensor([[5, 77, 300, 12, 9]])
        with torch.no_grad():
            hidden = model(input_ids=prompt, output_hidden_states=True).hidden_states
            torch.save([h.clone() for h in hidden], "hidden.pt")
            generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
        print("generated", generated[0].tolist())
        raise SystemExit(3)
    """)
    alone = run_python(f"import runpy; runpy.run_path({program!r}, run_name='__main__')", cwd=tmp_path)
    out = tmp_path / "run.h5"
    done = record("--out", str(out), "--watch", "model.layers.*", "--watch", "model.embed_tokens", "--",
                  sys.executable, program, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (alone.returncode, alone.stdout) == (3, alone.stdout)
    assert f"tracediff: wrote {out}: " in done.stderr
    hidden = torch.load(tmp_path / "hidden.pt", weights_only=True)
    generated = json.loads(alone.stdout.split("generated ")[1])
    with td.open_trace(out) as trace:
        assert trace.names() == ["target.embed", *(f"target.layer.{i}" for i in range(4))]
        first = {name: trace.rows(name, step=0) for name in trace.names()}
        assert torch.equal(torch.from_numpy(first["target.embed"].numpy()), hidden[0][0])
        for i in range(3):  # HF's last hidden state is after the final norm, not layer 3's output
            assert torch.equal(torch.from_numpy(first[f"target.layer.{i}"].numpy()), hidden[i + 1][0])
        assert first["target.layer.0"].position.tolist() == [0, 1, 2, 3, 4]
        # generate: the prefill and each decode forward continue one request, whose tokens the trace knows
        decode = trace.rows("target.layer.0", step=3)
        assert decode.position.tolist() == [6] and decode.token_id.tolist() == [generated[6]]
        assert trace.request_tokens().sequence(decode.request[0])[1].tolist() == generated[:7]


def test_sigterm_reaches_the_child_and_its_trace_still_closes(tmp_path) -> None:
    program = host(tmp_path, """
        import time, torch
        layer = torch.nn.Sequential(torch.nn.Linear(4, 4))
        layer(torch.ones(2, 4))
        print("ready", flush=True)
        time.sleep(60)
    """)
    out = tmp_path / "run.h5"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "from tracediff.cli import main; main()", "record", "--out", str(out),
         "--watch", "0", "--", sys.executable, program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL)
    assert launcher.stdout is not None and launcher.stdout.readline() == "ready\n"
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert time.monotonic() - started < launch.CLOSE_TIMEOUT
    with td.open_trace(out) as trace:
        assert trace.complete and trace.names() == ["0"]
        assert trace.finals[0]["records"] == 1


def test_processes_that_never_record_write_no_file_and_the_own_sitecustomize_still_runs(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_SITECUSTOMIZE'] = 'ran'\n")
    program = host(tmp_path, """
        import os, subprocess, sys, torch
        print("theirs:", os.environ.get("THEIR_SITECUSTOMIZE"))
        matches_nothing = "import torch; torch.nn.Linear(2, 2)(torch.ones(1, 2))"
        subprocess.run([sys.executable, "-c", matches_nothing], check=True)
        torch.nn.Sequential(torch.nn.Linear(2, 2))(torch.ones(1, 2))
    """)
    done = record("--out", str(tmp_path / "run.h5"), "--watch", "0", "--", sys.executable, program,
                  env={"PYTHONPATH": os.pathsep.join([str(theirs), str(REPO)])})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "theirs: ran\n"
    assert sorted(p.name for p in tmp_path.glob("run*")) == ["run.h5"]
    nothing = record("--out", str(tmp_path / "none.h5"), "--watch", "no.such.module", "--",
                     sys.executable, "-c", "import torch; torch.nn.Linear(2, 2)(torch.ones(1, 2))")
    assert nothing.returncode == 0 and "nothing was recorded" in nothing.stderr
    assert not list(tmp_path.glob("none*"))


runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("case", ["no command", "output exists", "rank file exists", "no output dir",
                                  "unknown plugin", "bad suffix", "no plugin"])
def test_bad_input_is_one_line_and_nothing_starts(tmp_path, case) -> None:
    marker = tmp_path / "started"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    out = tmp_path / "run.h5"
    args = {
        "no command": ["--out", str(out), "--watch", "x", "--"],
        "output exists": ["--out", str(out), "--watch", "x", *command],
        "rank file exists": ["--out", str(out), "--watch", "x", *command],
        "no output dir": ["--out", str(tmp_path / "missing" / "run.h5"), "--watch", "x", *command],
        "unknown plugin": ["--out", str(out), "--plugin", "tracediff.no_such_plugin", *command],
        "bad suffix": ["--out", str(tmp_path / "run.txt"), "--watch", "x", *command],
        "no plugin": ["--out", str(out), *command],
    }[case]
    if case == "output exists":
        out.write_bytes(b"precious")
    if case == "rank file exists":
        (tmp_path / "run.rank1.h5").write_bytes(b"precious")
    result = cli("record", *args)
    assert result.exit_code == 2
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("error: ")
    assert not marker.exists()
    if case == "output exists":
        assert out.read_bytes() == b"precious"


def test_sglang_server_with_cuda_graphs_is_refused_with_what_to_do(tmp_path) -> None:
    serve = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--speculative-algorithm", "EAGLE3"]
    result = cli("record", "--out", str(tmp_path / "serve.h5"), "--", *serve)
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert "add --disable-cuda-graph, or record only the eager path" in result.stderr
    for command in (serve, ["sglang", "serve", "--model-path", "m"]):
        assert launch.SGLANG_PLUGIN in launch.plugins_for(command, (), ())
        config = LaunchConfig(out=str(tmp_path / "serve.h5"), plugins=(launch.SGLANG_PLUGIN,))
        for accepted, eager_only in (([*command, "--disable-cuda-graph"], False), (command, True)):
            launch.check(config, accepted, eager_only=eager_only)
    assert launch.plugins_for(["python", "train.py"], (), ()) == ()


@pytest.mark.parametrize("command", [["specforge", "train", "--config", "c.yaml"],
                                     ["/opt/venv/bin/specforge", "train"],
                                     ["python", "-m", "specforge.cli", "train"]])
def test_a_specforge_training_command_gets_the_specforge_plugin(command) -> None:
    assert launch.plugins_for(command, (), ()) == (launch.SPECFORGE_PLUGIN,)


def test_a_script_that_merely_mentions_specforge_gets_no_plugin() -> None:
    assert launch.plugins_for(["python", "train.py", "--config", "specforge.yaml"], (), ()) == ()


def test_launch_config_travels_through_the_environment() -> None:
    config = LaunchConfig(out="/x/run.h5", plugins=("a.b",), watch=("model.*",), names=("target.*",),
                          exclude=("*.logits",), every=4, requests=2, match_prefix=(1, 2))
    assert LaunchConfig.from_env(config.to_env()) == config
    env = launch.child_env(config, {"PYTHONPATH": "/theirs"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(launch.STARTUP_DIR), "/theirs"])
    assert (launch.STARTUP_DIR / "sitecustomize.py").is_file()


def test_recorder_factory_is_lazy_per_rank_and_never_clobbers(tmp_path) -> None:
    config = LaunchConfig(out=str(tmp_path / "run.h5"), plugins=(), every=2)
    first = launch._ProcessRecorder(config)
    assert not list(tmp_path.iterdir())  # nothing until something records
    rec = first(rank=1, world_size=2)
    assert first() is rec and rec.path == tmp_path / "run.rank1.h5" and rec.filter.every == 2
    other_process = launch._ProcessRecorder(config)(rank=1, world_size=2)  # the same rank again
    assert other_process.path == tmp_path / f"run.pid{os.getpid()}.rank1.h5"
    for r in (rec, other_process):
        r.log("x", torch.ones(2, 3), token_ids=[7, 8], step=0)
        r.close()
    assert [(f.path.name, f.records, f.closed) for f in launch.written(tmp_path / "run.h5")] == [
        (f"run.pid{os.getpid()}.rank1.h5", 1, True), ("run.rank1.h5", 1, True)]


def test_request_gate_admits_the_first_requests_with_the_prefix() -> None:
    gate = RequestGate(limit=2, prefix=(1, 2))
    assert [gate.admit(r, t) for r, t in (("a", [1, 2, 3]), ("b", [9, 2]), ("c", [1, 2]), ("d", [1, 2]))] == [
        True, False, True, False]
    assert gate.admit("a") and not gate.admit("b")


def test_watch_with_requests_and_match_prefix_records_only_the_admitted_requests(tmp_path) -> None:
    from tests.conftest import tiny_llama
    from tracediff.record.watch_plugin import Watcher

    model = tiny_llama(seed=0, layers=2)
    prompts = [[5, 77, 300], [17, 3, 250, 4], [17, 3, 9], [17, 3, 1]]
    config = LaunchConfig(out=str(tmp_path / "run.h5"), plugins=(), watch=("model.layers.0",), requests=2,
                          match_prefix=(17, 3))
    factory = launch._ProcessRecorder(config)
    watcher = Watcher(config, factory)
    watcher.install(torch)
    try:
        with torch.no_grad():
            for tokens in prompts:
                model(input_ids=torch.tensor([tokens]))
    finally:
        watcher.handle.remove()
    factory.close()
    with td.open_trace(tmp_path / "run.h5") as trace:
        rows = trace.rows("target.layer.0")
        assert sorted(set(rows.request)) == ["s1b0", "s2b0"]  # not s0b0 (prefix), not s3b0 (third)
        assert rows.token_id.tolist() == [*prompts[1], *prompts[2]]
