"""`--watch` on hostile PyTorch programs: whatever the program does with its modules (pickles them,
copies them, scripts or compiles them, grows them after the first forward, calls them from threads or
from inside themselves, returns odd things or raises), the program runs as it would unwatched, and
what is recorded is keyed by the call that produced it. A failure is logged once and stops the
watching, never the program."""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import tracediff as td
from tracediff.record import child
from tracediff.record.plugin import LaunchConfig

torch = pytest.importorskip("torch")
from torch.nn.modules import module as torch_module  # noqa: E402

from tracediff.integrations.torch_watch.watcher import Watcher  # noqa: E402


@contextmanager
def watching(path: Path, *globs: str) -> Iterator[Watcher]:
    """A --watch Watcher in this process, recording into ``path``; the trace is closed on leaving."""
    config = LaunchConfig(out=str(path), plugins=(), watch=globs)
    factory = child._ProcessRecorder(config)
    watcher = Watcher(config, factory)
    watcher.install(torch)
    try:
        yield watcher
    finally:
        watcher.remove()
        factory.close()


def ours_installed(watcher: Watcher) -> bool:
    hooks = [*torch_module._global_forward_pre_hooks.values(), *torch_module._global_forward_hooks.values()]
    return any(getattr(h, "__self__", None) is watcher for h in hooks)


def counts(path: Path) -> dict[str, int]:
    with td.open_trace(path) as trace:
        return {name: len(trace.select(name=name)) for name in trace.names()}


class Tokens(torch.nn.Module):
    """An HF-style root: input_ids in, embedding then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin = torch.nn.Embedding(32, 4), torch.nn.Linear(4, 4)

    def forward(self, input_ids, past_key_values=None):
        return self.lin(self.emb(input_ids))


def small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))


X = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 24


def test_a_failure_computing_row_keys_is_logged_once_and_never_reaches_the_program(tmp_path, caplog) -> None:
    """The root's keys are read in a hook torch calls before the forward: an exception there (here a
    cache object that breaks) used to raise in the program from the second call on."""
    class BrokenCache:
        calls = 0

        def get_seq_length(self) -> int:
            BrokenCache.calls += 1
            if BrokenCache.calls > 1:
                raise RuntimeError("cache broke")
            return 0

    model = Tokens()
    ids = torch.tensor([[1, 2, 3]])
    with caplog.at_level(logging.WARNING, logger="tracediff"), watching(tmp_path / "t.h5", "lin") as watcher:
        outputs = [model(input_ids=ids, past_key_values=BrokenCache()) for _ in range(3)]
        assert watcher.failed and not ours_installed(watcher)  # gone at the next module call
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    stopped = [r.getMessage() for r in caplog.records if "--watch stopped" in r.getMessage()]
    assert len(stopped) == 1 and "RuntimeError: cache broke" in stopped[0]
    assert counts(tmp_path / "t.h5") == {"lin": 1}  # the first call, recorded before the failure


def test_a_watched_model_still_pickles_deep_copies_and_scripts(tmp_path) -> None:
    """Hooks stored on the modules made torch.save(model) and torch.jit.script(model) raise in the
    program, and a deep copy carried them: its outputs were recorded twice."""
    model = small_net()
    with watching(tmp_path / "t.h5", "*"):
        expected = model(X)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        twin = copy.deepcopy(model)
        assert torch.equal(twin(X), expected)
        assert torch.equal(torch.jit.script(model)(X), expected)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(X), expected)
    assert counts(tmp_path / "t.h5") == {"0": 2, "1": 2, "2": 2}  # the model's call and the copy's


def test_modules_added_after_the_first_forward_are_watched_under_their_own_names(tmp_path) -> None:
    """A block appended to a root after its first forward used to become a root of its own: its
    layers were recorded as '0' and '1', the names of the root's own layers."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with watching(tmp_path / "t.h5", "**"):
        model(X)
        model.append(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
        model(X)
    with td.open_trace(tmp_path / "t.h5") as trace:
        assert counts(tmp_path / "t.h5") == {"0": 2, "1": 2, "2.0": 1, "2.1": 1, "2": 1}
        assert sorted(set(trace.keys("2.0").request.tolist())) == ["s1b0", "s1b1"]  # the root's call 1
        assert np.array_equal(trace.rows("2.1").numpy().reshape(2, 3, 4), model(X).detach().numpy())


ALONE = "TRACEDIFF_TEST_ALONE"


def rerun_alone(request: pytest.FixtureRequest) -> bool:
    """Run this test again in a fresh interpreter and check it passed there; True in the parent.
    torch's compiler state is process-wide: in the suite, SGLang's triton stub (installed by other
    tests) and conftest's dynamo switch would decide what a user's program never sees."""
    if os.environ.get(ALONE) == request.node.nodeid:
        return False
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"} | {ALONE: request.node.nodeid}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
    done = subprocess.run(argv, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=300)
    passed = any(line.startswith("1 passed") for line in done.stdout.splitlines())
    assert done.returncode == 0 and passed, done.stdout[-3000:] + done.stderr[-2000:]
    return True


@pytest.mark.slow
@pytest.mark.subprocess
def test_torch_compile_fullgraph_runs_and_what_it_does_not_record_is_said(tmp_path, caplog, monkeypatch,
                                                                         request) -> None:
    """Traced by dynamo, the hooks broke the graph: fullgraph=True raised in the program. Compiled
    code is not recorded (it calls no Python hooks), said once; eager calls still are."""
    if rerun_alone(request):
        return
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # conftest's, for SpecForge's tests
    monkeypatch.setattr(torch._dynamo.config, "disable", False)  # read from it when dynamo was imported
    model = small_net()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert type(compiled).__name__ == "OptimizedModule"
    with caplog.at_level(logging.WARNING, logger="tracediff"), watching(tmp_path / "t.h5", "*") as watcher:
        assert torch.equal(compiled(X), model(X)) and torch.equal(compiled(X * 2), model(X * 2))
        assert not watcher.failed
    said = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(said) == 1 and "TORCH_COMPILE_DISABLE=1" in said[0]
    assert counts(tmp_path / "t.h5") == {"0": 2, "1": 2, "2": 2}  # the two eager calls


@pytest.mark.slow
@pytest.mark.subprocess
def test_torch_export_runs_and_recording_goes_on(tmp_path, request) -> None:
    """export traces with FakeTensors: logged, they stopped the recorder's writer for the rest of the
    run (".numpy() is not supported for tensor subclasses")."""
    if rerun_alone(request):
        return
    model = small_net()
    with watching(tmp_path / "t.h5", "*") as watcher:
        model(X)
        exported = torch.export.export(model, (X,))
        model(X)
        assert not watcher.failed
    assert torch.equal(exported.module()(X), model(X))
    with td.open_trace(tmp_path / "t.h5") as trace:
        assert trace.finals[0]["stopped"] is None
        assert sorted(set(trace.keys("2").step.tolist())) == [0, 1]


class Waiting(Tokens):
    """Both threads' calls are inside the forward before either reaches the linear layer."""

    barrier = threading.Barrier(2, timeout=20)

    def forward(self, input_ids, past_key_values=None):
        hidden = self.emb(input_ids)
        self.barrier.wait()
        return self.lin(hidden)


def test_threads_calling_one_model_keep_their_own_row_keys(tmp_path) -> None:
    """One shared slot per root: the second thread's call overwrote the first's keys, so the first's
    rows were recorded under the other request's tokens."""
    model, prompts = Waiting(), [torch.tensor([[1, 2, 3]]), torch.tensor([[7, 8, 9]])]
    with watching(tmp_path / "t.h5", "lin"), torch.no_grad():
        threads = [threading.Thread(target=model, kwargs={"input_ids": ids}) for ids in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    with td.open_trace(tmp_path / "t.h5") as trace:
        rows = trace.rows("lin")
        assert sorted(rows.token_id.reshape(2, 3).tolist()) == [[1, 2, 3], [7, 8, 9]]
        with torch.no_grad():  # every row holds what the model makes of the token it is keyed by
            assert np.allclose(rows.numpy(), model.lin(model.emb(torch.from_numpy(rows.token_id))).numpy())
        assert len(set(rows.request.tolist())) == 2


class Recursive(Tokens):
    def forward(self, input_ids, depth: int = 1):
        hidden = self.emb(input_ids)
        if depth:
            self(input_ids=input_ids[:, :-1], depth=depth - 1)
        return self.lin(hidden)


def test_a_root_called_inside_its_own_forward_keeps_the_outer_calls_keys(tmp_path) -> None:
    """The inner call's end cleared the root's keys: the outer call's later outputs became static."""
    with watching(tmp_path / "t.h5", "lin"), torch.no_grad():
        Recursive()(input_ids=torch.tensor([[4, 5, 6]]))
    with td.open_trace(tmp_path / "t.h5") as trace:
        keys = trace.keys("lin")
        assert not trace.index.static[trace.select(name="lin")].any()
        assert keys.token_id.tolist() == [4, 5, 4, 5, 6] and keys.step.tolist() == [1, 1, 0, 0, 0]


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor


class Odd(torch.nn.Module):
    """Children returning what modules may return."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


def test_odd_module_outputs_neither_fail_the_program_nor_stop_the_recording(tmp_path) -> None:
    items = []

    def generate(x):
        items.append("started")
        yield x

    children = {
        "pair": lambda x: ("text", x + 1), "mapping": lambda x: {"n": 3, "h": x + 2},
        "dataclass": lambda x: Output(x), "none": lambda x: None, "generator": generate,
        "number": lambda x: 7, "complex": lambda x: x.to(torch.complex64),
        "nine_dims": lambda x: x.reshape(1, 1, 1, 1, 1, 1, 2, 3, 4), "list": lambda x: [x + 3],
    }
    class Root(torch.nn.ModuleDict):
        def forward(self, x):
            return {name: child(x) for name, child in self.items()}

    root = Root({name: Odd(make) for name, make in children.items()})
    with watching(tmp_path / "t.h5", "*") as watcher:
        outputs = root(X)
        assert not watcher.failed
    assert items == [] and list(outputs["generator"]) == [X] and items == ["started"]  # never consumed by us
    with td.open_trace(tmp_path / "t.h5") as trace:
        assert sorted(trace.names()) == ["list", "mapping", "pair"]
        assert np.array_equal(trace.rows("mapping").numpy(), (X + 2).numpy().reshape(6, 4))
        assert trace.finals[0]["stopped"] is None
        assert trace.finals[0]["dropped_reasons"] == {"unrecordable: 9 dims (at most 8)": 1}


def test_an_exception_in_a_module_reaches_the_program_unchanged_and_the_next_call_is_keyed(tmp_path) -> None:
    class Fails(Tokens):
        fail = True

        def forward(self, input_ids, past_key_values=None):
            hidden = self.lin(self.emb(input_ids))
            if self.fail:
                raise ValueError("boom")
            return hidden

    model, raised = Fails(), ValueError("unused")
    with watching(tmp_path / "t.h5", "lin") as watcher:
        with pytest.raises(ValueError) as caught:
            model(input_ids=torch.tensor([[1, 2]]))
        raised = caught.value
        model.fail = False
        model(input_ids=torch.tensor([[3, 4, 5]]))
        assert not watcher.failed and watcher.calls() == []
    assert str(raised) == "boom"
    with td.open_trace(tmp_path / "t.h5") as trace:
        keys = trace.keys("lin")
        assert keys.token_id.tolist() == [1, 2, 3, 4, 5] and keys.step.tolist() == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_outputs_are_recorded_exactly_under_every_autograd_mode(tmp_path, mode) -> None:
    model = small_net()
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with watching(tmp_path / "t.h5", "2"), context():
        out = model(X)
    with td.open_trace(tmp_path / "t.h5") as trace:
        assert np.array_equal(trace.rows("2").numpy(), out.detach().reshape(6, 4).numpy())


def test_a_glob_that_matches_no_module_names_the_modules_it_could_have_matched(tmp_path, caplog) -> None:
    """A mistyped --watch glob records nothing of its own: at exit one line per such glob names the
    models' first module names (shallowest first) and their count, and the closest to the glob; a
    glob that matched is not named."""
    from tests.conftest import tiny_llama

    model = tiny_llama(seed=0, layers=2)
    names = [n for n, _ in model.named_modules() if n]
    ids = torch.tensor([[1, 2, 3]])
    with caplog.at_level(logging.WARNING, logger="tracediff"), \
            watching(tmp_path / "t.h5", "model.layer.*", "lm_head", "transformer.h.*") as watcher:
        with torch.no_grad():
            model(input_ids=ids)
        watcher.report_unmatched()
    lines = [r.getMessage() for r in caplog.records if "matched no module" in r.getMessage()]
    first = "model, lm_head, model.embed_tokens, model.layers, model.norm, model.rotary_emb, " \
            f"model.layers.0, model.layers.1, ... ({len(names)} in all)"
    assert lines == [
        f"tracediff: --watch 'model.layer.*' matched no module of the models that ran: {first}; did you mean "
        "'model.layers.0', 'model.layers.1' or 'model.layers'?",
        f"tracediff: --watch 'transformer.h.*' matched no module of the models that ran: {first}"]
    assert "lm_head" in counts(tmp_path / "t.h5")
