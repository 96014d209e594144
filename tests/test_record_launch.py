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
from tracediff.integrations.registry import PRODUCERS
from tracediff.integrations.sglang.producer import PRODUCER as SGLANG
from tracediff.integrations.specforge.producer import PRODUCER as SPECFORGE
from tracediff.integrations.torch_watch.producer import PRODUCER as TORCH_WATCH
from tracediff.record import child, launch
from tracediff.record.plugin import LaunchConfig, RequestGate

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY_LLAMA = """
import torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
model = transformers.LlamaForCausalLM(config).eval()
"""


def plugins_for(command: list[str], **options) -> tuple[str, ...]:
    """The plugins ``tracediff record`` loads for ``command``, as the registry's producers claim it."""
    return launch.plugins_for(LaunchConfig(out="run.h5", plugins=(), **options), command, (), PRODUCERS)


def host(tmp_path, body: str, head: str = "") -> str:
    """A host program file: what a user runs under `tracediff record`."""
    path = tmp_path / "host.py"
    path.write_text(head + textwrap.dedent(body))
    return str(path)


def record(*args: str, **kw) -> subprocess.CompletedProcess:
    """The real CLI in a fresh interpreter: ``tracediff record ARGS``."""
    return run_python("from tracediff.cli import main; main()", "record", *args, **kw)


@pytest.mark.slow
@pytest.mark.subprocess
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


@pytest.mark.slow
@pytest.mark.subprocess
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
    assert time.monotonic() - started < child.CLOSE_TIMEOUT
    with td.open_trace(out) as trace:
        assert trace.complete and trace.names() == ["0"]
        assert trace.finals[0]["records"] == 1


@pytest.mark.slow
@pytest.mark.subprocess
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
    failed = record("--out", str(tmp_path / "failed.h5"), "--watch", "0", "--",
                    sys.executable, "-c", "import sys; sys.exit(3)")
    said = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode == 3  # the command's own exit code, and its failure named first
    assert said.startswith("tracediff: nothing was recorded: the command failed (exit 3) before anything "
                           "was recorded; or "), failed.stderr


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
        assert plugins_for(command) == (SGLANG.plugin,)
        for accepted, eager_only in (([*command, "--disable-cuda-graph"], False), (command, True)):
            config = LaunchConfig(out=str(tmp_path / "serve.h5"), plugins=(SGLANG.plugin,),
                                  eager_only=eager_only)
            launch.check(config, accepted, PRODUCERS)
    assert plugins_for(["python", "train.py"]) == ()


def test_an_attached_module_flag_is_read_too() -> None:
    serve = ["python", "-msglang.launch_server", "--port", "1"]
    assert plugins_for(serve) == (SGLANG.plugin,)
    assert plugins_for(["python", "-mspecforge.cli", "train"]) == (SPECFORGE.plugin,)


def test_an_empty_watch_glob_is_refused(tmp_path) -> None:
    result = cli("record", "--out", str(tmp_path / "w.h5"), "--watch", "", "--", "python", "-c", "pass")
    assert result.exit_code == 2 and "--watch: an empty module glob" in result.stderr
    assert not (tmp_path / "w.h5").exists()


@pytest.mark.parametrize("command", [["specforge", "train", "--config", "c.yaml"],
                                     ["/opt/venv/bin/specforge", "train"],
                                     ["python", "-m", "specforge.cli", "train"]])
def test_a_specforge_training_command_gets_the_specforge_plugin(command) -> None:
    assert plugins_for(command) == (SPECFORGE.plugin,)


def test_a_script_that_merely_mentions_specforge_gets_no_plugin() -> None:
    assert plugins_for(["python", "train.py", "--config", "specforge.yaml"]) == ()


def test_launch_config_travels_through_the_environment() -> None:
    config = LaunchConfig(out="/x/run.h5", plugins=("a.b",), watch=("model.*",), names=("target.*",),
                          exclude=("*.logits",), every=4, requests=2, match_prefix=(1, 2))
    assert LaunchConfig.from_env(config.to_env()) == config
    env = launch.child_env(config, {"PYTHONPATH": "/theirs"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(launch.STARTUP_DIR), "/theirs"])
    assert (launch.STARTUP_DIR / "sitecustomize.py").is_file()


def test_recorder_factory_is_lazy_per_rank_and_never_clobbers(tmp_path) -> None:
    config = LaunchConfig(out=str(tmp_path / "run.h5"), plugins=(), every=2)
    first = child._ProcessRecorder(config)
    assert not list(tmp_path.iterdir())  # nothing until something records
    rec = first(rank=1, world_size=2)
    assert first() is rec and rec.path == tmp_path / "run.rank1.h5" and rec.filter.every == 2
    other_process = child._ProcessRecorder(config)(rank=1, world_size=2)  # the same rank again
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
    from tracediff.integrations.torch_watch.watcher import Watcher

    model = tiny_llama(seed=0, layers=2)
    prompts = [[5, 77, 300], [17, 3, 250, 4], [17, 3, 9], [17, 3, 1]]
    config = LaunchConfig(out=str(tmp_path / "run.h5"), plugins=(), watch=("model.layers.0",), requests=2,
                          match_prefix=(17, 3))
    factory = child._ProcessRecorder(config)
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


# ---- where files go, forks, signals: CLI runs with a numpy-only probe plugin (no torch: fast) --------

PROBE = '''
"""A recording plugin for these tests: hands this process's recorder factory to the program."""
factory = None


def at_startup(config, recorder):
    global factory
    factory = recorder


def log(step, rows=2):
    import numpy as np
    factory(source="probe").log("x", np.full((rows, 4), step, np.float32), token_ids=[7] * rows, step=step)
'''


def probe_env(tmp_path) -> dict:
    (tmp_path / "probe.py").write_text(PROBE)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


def steps_by_file(out) -> dict[str, list[int]]:
    """Every file a run wrote (all must be closed), with the steps of its records."""
    files = launch.written(out)
    assert all(f.closed for f in files), [(f.path.name, f.records) for f in files]
    found = {}
    for f in files:
        with td.open_trace(f.path) as trace:
            found[f.path.name] = sorted(int(s) for s in trace.index.step[trace.select(name="x")])
    return found


@pytest.mark.subprocess
def test_a_relative_out_is_the_launchers_even_when_the_program_changes_directory(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    program = host(tmp_path, """
        import os, probe
        os.chdir("sub")
        probe.log(0)
    """)
    done = record("--out", "rel.h5", "--plugin", "probe", "--", sys.executable, program, cwd=tmp_path,
                  env=probe_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert not list((tmp_path / "sub").iterdir())
    assert f"tracediff: wrote {tmp_path / 'rel.h5'}: 1 records\n" in done.stderr
    assert steps_by_file(tmp_path / "rel.h5") == {"rel.h5": [0]}


@pytest.mark.slow
@pytest.mark.subprocess
def test_forked_children_record_to_files_of_their_own_closed_however_they_end(tmp_path) -> None:
    program = host(tmp_path, """
        import multiprocessing as mp, os, sys, time
        import probe

        def work(step):
            probe.log(step)

        if __name__ == "__main__":
            probe.log(0)  # the parent records first: every fork below inherits its open recorder
            fork = mp.get_context("fork")
            for step in (1, 2):  # multiprocessing ends a child with os._exit: no atexit
                child = fork.Process(target=work, args=(step,))
                child.start()
                child.join()
            with fork.Pool(2) as pool:  # leaving the block terminates the workers, maybe mid-close
                pool.map(work, [3, 4, 5, 6])
            with mp.get_context("spawn").Pool(2) as pool:
                pool.map(work, [7, 8])
            parent = os.getpid()
            if os.fork() == 0:  # a bare fork that exits normally once the parent has closed its file
                work(9)
                while os.getppid() == parent:
                    time.sleep(0.01)
                sys.exit(0)
            probe.log(10)
    """)
    out = tmp_path / "run.h5"
    done = record("--out", str(out), "--plugin", "probe", "--", sys.executable, program,
                  env=probe_env(tmp_path))  # returns once the last process has closed its stdout
    assert done.returncode == 0, done.stderr
    found = steps_by_file(out)
    assert found.pop("run.h5") == [0, 10]  # the parent's file, intact after its forks exited
    assert sorted(s for steps in found.values() for s in steps) == list(range(1, 10))
    assert all(name.startswith("run.pid") for name in found)


@pytest.mark.slow
@pytest.mark.subprocess
def test_ctrl_c_at_exit_neither_cuts_the_close_short_nor_prints_a_traceback(tmp_path) -> None:
    program = host(tmp_path, """
        import atexit, os, signal, threading, time
        import numpy as np
        import probe

        rows = 4096  # 32 MiB still queued at exit: the close takes a while
        probe.factory(source="probe").log("big", np.zeros((rows, 2048), np.float32), token_ids=[7] * rows)

        def ctrl_c_again_and_again():
            def loop():
                while True:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.002)
            threading.Thread(target=loop, daemon=True).start()

        atexit.register(ctrl_c_again_and_again)  # runs first: atexit is last in, first out
    """)
    out = tmp_path / "run.h5"
    done = record("--out", str(out), "--plugin", "probe", "--", sys.executable, program,
                  env=probe_env(tmp_path))
    assert "Recorder.close" not in done.stderr and "tracediff/record" not in done.stderr, done.stderr
    assert [(f.records, f.closed) for f in launch.written(out)] == [(1, True)]


@pytest.mark.subprocess
@pytest.mark.parametrize("redirected", [(0,), (0, 1, 2)], ids=["stdin", "stdin-stdout-stderr"])
def test_ctrl_c_in_a_terminal_reaches_the_child_once_with_its_fds_redirected(tmp_path, redirected) -> None:
    import pty

    count, ready = tmp_path / "count", tmp_path / "ready"
    program = host(tmp_path, f"""
        import signal, time
        got = []
        signal.signal(signal.SIGINT, lambda *_: got.append(time.monotonic()))
        open({str(ready)!r}, "w").close()
        end = time.monotonic() + 20
        while time.monotonic() < end and not (got and time.monotonic() > got[0] + 1):
            time.sleep(0.02)
        open({str(count)!r}, "w").write(str(len(got)))
    """)
    argv = [sys.executable, "-c", "from tracediff.cli import main; main()", "record", "--out",
            str(tmp_path / "run.h5"), "--watch", "x", "--", sys.executable, program]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pid, terminal = pty.fork()
    if pid == 0:  # a session of its own, the pty as its controlling terminal: Ctrl-C goes to its group
        try:
            for fd in redirected:
                os.dup2(os.open(os.devnull, os.O_RDWR), fd)
            os.execve(sys.executable, argv, env)
        finally:
            os._exit(127)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.write(terminal, b"\x03")
        while True:  # drain the terminal until the session ends
            try:
                if not os.read(terminal, 4096):
                    break
            except OSError:
                break
    finally:
        os.waitpid(pid, 0)
        os.close(terminal)
    assert count.read_text() == "1"


# ---- --watch in-process: what gets recorded, under which keys, and what compare makes of it ----------


@pytest.fixture(scope="module")
def llama():
    from tests.conftest import tiny_llama

    return tiny_llama(seed=0, layers=2)


def watch_run(path, calls, **options):
    """``calls()`` under a --watch Watcher in this process, into ``path``; returns the watcher."""
    from tracediff.integrations.torch_watch.watcher import Watcher

    config = LaunchConfig(out=str(path), plugins=(), **options)
    factory = child._ProcessRecorder(config)
    watcher = Watcher(config, factory)
    watcher.install(torch)
    try:
        with torch.no_grad():
            calls()
    finally:
        watcher.remove()
        factory.close()
    return watcher


def test_watch_all_modules_never_takes_the_root_and_records_every_forward(tmp_path, llama) -> None:
    prompt = torch.tensor([[5, 77, 300]])
    watcher = watch_run(tmp_path / "run.h5", lambda: [llama(input_ids=prompt) for _ in range(2)],
                        watch=("**",))
    assert not watcher.failed
    with td.open_trace(tmp_path / "run.h5") as trace:
        assert "" not in trace.names() and {"target.layer.1", "lm_head", "model.norm"} <= set(trace.names())
        assert sorted(set(trace.keys("target.layer.1").step.tolist())) == [0, 1]


def test_outputs_of_calls_without_token_ids_are_keyed_by_step_and_position_and_compare_by_step(tmp_path):
    def program(perturb_at: int | None = None, steps: int = 3):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        inputs = [torch.randn(3, 5, 8), torch.randn(4, 8), torch.randn(3, 5, 8)][:steps]  # [B, T, H], [N, H]

        def calls():
            for step, x in enumerate(inputs):
                if step == perturb_at:
                    net[2].weight.mul_(1.01)
                net(x)
        return calls

    for name, perturb_at in (("a", None), ("b", None), ("c", 2)):
        watch_run(tmp_path / f"{name}.h5", program(perturb_at), watch=("*",))
    with td.open_trace(tmp_path / "a.h5") as trace:
        rows = trace.keys("2")
        assert (rows.token_id == -1 - rows.step).all()  # a placeholder: never a vocabulary id
        assert rows.position.tolist() == [*range(5)] * 3 + [*range(4)] + [*range(5)] * 3
        assert sorted(set(rows.request.tolist())) == ["s0b0", "s0b1", "s0b2", "s1", "s2b0", "s2b1", "s2b2"]
    assert launch.written(tmp_path / "a.h5")[0].row_keys == "step_position"  # the contract says so
    fewer = tmp_path / "two_steps.h5"  # the same program, stopped one step earlier
    watch_run(fewer, program(None, steps=2), watch=("*",))
    for align in ("step", "prefix"):  # the placeholder names the step: content alignment pairs by step too
        same = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", align=align)
        assert same.verdict == "match" and (same.coverage.compared_a, same.coverage.compared_b) == (102, 102)
        changed = td.compare(tmp_path / "a.h5", tmp_path / "c.h5", align=align)
        assert changed.verdict == "diverged"
        assert (changed.first_divergence.name, changed.first_divergence.row.step_a) == ("2", 2)
        shorter = td.compare(tmp_path / "a.h5", fewer, align=align)
        assert shorter.verdict == "match" and shorter.coverage.compared_b == 57  # its two steps, no more


def test_inputs_embeds_rows_never_align_with_rows_of_real_tokens(tmp_path, llama) -> None:
    prompt = torch.tensor([[5, 77, 300]])
    watch_run(tmp_path / "ids.h5", lambda: llama(input_ids=prompt), watch=("model.layers.*",))
    watch_run(tmp_path / "embeds.h5", lambda: llama(inputs_embeds=llama.model.embed_tokens(prompt)),
              watch=("model.layers.*",))
    with td.open_trace(tmp_path / "ids.h5") as ids, td.open_trace(tmp_path / "embeds.h5") as embeds:
        by_ids, by_embeds = ids.rows("target.layer.1"), embeds.rows("target.layer.1")
        assert torch.equal(torch.from_numpy(by_ids.numpy()), torch.from_numpy(by_embeds.numpy()))
        assert by_embeds.position.tolist() == [0, 1, 2] and by_embeds.token_id.tolist() == [-1, -1, -1]
    assert td.compare(tmp_path / "ids.h5", tmp_path / "embeds.h5").verdict == "incomparable"


def test_lm_head_under_generate_is_keyed_at_every_step_from_the_prefills_last_token_on(tmp_path, llama):
    prompt = torch.tensor([[5, 77, 300, 12]])
    generated: list[int] = []

    def generate() -> None:
        out = llama.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        generated.extend(out[0].tolist())

    watch_run(tmp_path / "run.h5", generate, watch=("lm_head",))
    full = llama(input_ids=torch.tensor([generated[:6]])).logits[0]
    with td.open_trace(tmp_path / "run.h5") as trace:
        assert trace.finals[0]["mixed_records"] == []
        rows = trace.rows("lm_head")
        assert rows.step.tolist() == [0, 1, 2] and rows.position.tolist() == [3, 4, 5]
        assert rows.token_id.tolist() == generated[3:6]
        assert torch.allclose(torch.from_numpy(rows.numpy()), full[3:6], atol=1e-5)
        assert trace.request_tokens().sequence(rows.request[0])[1].tolist() == generated[:6]


def test_the_contract_names_the_hf_model_so_other_models_are_incomparable(tmp_path) -> None:
    from tests.conftest import tiny_llama
    from tracediff.integrations.torch_watch.names import model_identity

    prompt = torch.tensor([[5, 77, 300]])
    for name, model in (("a", tiny_llama(seed=0, layers=2)), ("other_weights", tiny_llama(seed=1, layers=2)),
                        ("other_model", tiny_llama(seed=0, layers=3))):
        watch_run(tmp_path / f"{name}.h5", lambda m=model: m(input_ids=prompt), watch=("model.layers.*",))
    # other weights: the embedding fingerprint differs, so another target unless the user says otherwise
    other = td.compare(tmp_path / "a.h5", tmp_path / "other_weights.h5")
    assert other.verdict == "incomparable" and "target_embedding_sha256" in other.reasons[0]
    declared = td.compare(tmp_path / "a.h5", tmp_path / "other_weights.h5", same_target=True)
    assert declared.verdict == "diverged"
    report = td.compare(tmp_path / "a.h5", tmp_path / "other_model.h5")
    assert report.verdict == "incomparable" and "different target models" in report.reasons[0]
    named = tiny_llama(seed=0, layers=2)
    named.config._name_or_path = "org/tiny-llama"
    assert model_identity(named) == "org/tiny-llama"


@pytest.mark.parametrize("options, named", [
    ({"names": ("target.*",), "exclude": ("target.*",)}, "--names target.* --exclude target.*"),
    ({"match_prefix": (2,)}, "--match-prefix 2")])
def test_filters_that_keep_nothing_write_nothing_and_say_so_by_name(tmp_path, llama, caplog, options,
                                                                    named) -> None:
    prompt = torch.tensor([[5, 77, 300]])
    watcher = watch_run(tmp_path / "run.h5", lambda: llama(input_ids=prompt), watch=("model.layers.*",),
                        **options)
    assert not list(tmp_path.iterdir())
    with caplog.at_level("WARNING", logger="tracediff"):
        watcher.report_left_out()
    assert f"its watched modules ran, but {named} left out everything" in caplog.text
    config = LaunchConfig(out="run.h5", plugins=(TORCH_WATCH.plugin,), watch=("model.layers.*",), **options)
    said = launch.nothing_recorded(config, PRODUCERS)
    assert said.startswith(f"nothing was recorded: {named} may have left out")


def test_a_ctrl_c_held_off_during_a_close_reaches_the_host_once_the_close_is_done() -> None:
    """The close is not cut short, and the host's Ctrl-C is not lost: it is raised right after (the
    host's handler here is Python's own, whatever an earlier test in this worker left in place)."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with child._sigint_held():
                signal.raise_signal(signal.SIGINT)  # held off: the close goes on
                done.append("the close ran to its end")
        assert done == ["the close ran to its end"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_a_ctrl_c_while_closing_at_exit_stays_held_off() -> None:
    before = signal.getsignal(signal.SIGINT)
    try:
        with child._sigint_held(restore=False):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the process is ending: every later one is held off too
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_request_gate_forgets_finished_requests_and_keeps_its_count() -> None:
    from tracediff.record.plugin import RequestGate

    gate = RequestGate(limit=2, prefix=None)
    assert [gate.admit(r) for r in ("a", "b", "c")] == [True, True, False]
    for r in ("a", "b", "c"):
        gate.forget(r)
    assert (gate.admitted, gate.refused) == (set(), set())
    assert not gate.admit("d")  # two were admitted: the limit still holds
