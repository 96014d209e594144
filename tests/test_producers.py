"""The producer registry: every folder under tracediff/integrations/ is one producer behind one
interface, the launcher and the CLI learn producers only from the registry, and a producer added to
it is claimed, refused, hinted at and imported from without a line of launcher or CLI code."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import typer

from tests.conftest import REPO, cli, run_python
from tracediff.errors import InputError
from tracediff.integrations.producer import Importer, Producer
from tracediff.integrations.registry import PRODUCERS
from tracediff.record import launch
from tracediff.record.plugin import LaunchConfig

INTEGRATIONS = REPO / "tracediff" / "integrations"
FOLDERS = sorted(p.parent.name for p in INTEGRATIONS.glob("*/__init__.py"))


def at_startup(config, recorder) -> None:
    """This module is the toy producer's plugin (check() needs an importable module with at_startup)."""


def toy_import(out: Path = typer.Option(..., "--out")) -> list[str]:
    """A toy producer's dump into a trace."""
    if out.suffix != ".h5":
        raise InputError(out, "the output must end in .h5")
    return [f"wrote {out}"]


def toy_refuses(config: LaunchConfig, command: list[str]) -> str | None:
    return None if "--eager" in command else "toy serves only with --eager"


TOY = Producer(name="toy", plugin=__name__, claims=lambda config, command: "toy-serve" in command,
               refuse=toy_refuses, silent_hint="the toy server had no requests",
               importers=(Importer("toy-dump", toy_import, needs_torch=False),))


def test_every_producer_folder_is_one_registry_line() -> None:
    assert FOLDERS == ["sglang", "specforge", "torch_watch", "vllm"]
    for folder in FOLDERS:
        producer = importlib.import_module(f"tracediff.integrations.{folder}.producer").PRODUCER
        assert producer in PRODUCERS and producer.plugin.startswith(f"tracediff.integrations.{folder}.")
        assert callable(importlib.import_module(producer.plugin).at_startup)
    assert len({p.name for p in PRODUCERS}) == len(PRODUCERS) == len(FOLDERS)


@pytest.mark.parametrize("module", ["tracediff/record/launch.py", "tracediff/record/child.py",
                                    "tracediff/record/plugin.py", "tracediff/cli.py"])
def test_the_launcher_and_the_cli_name_no_producer(module: str) -> None:
    tree = ast.parse((REPO / module).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    folders = {f"tracediff.integrations.{folder}" for folder in FOLDERS}
    assert not {m for m in imported if any(m == f or m.startswith(f + ".") for f in folders)}
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    homes = [p.plugin.rsplit(".", 1)[0] for p in PRODUCERS]
    named = [s for s in strings if "--disable-cuda-graph" in s or any(home in s for home in homes)]
    assert named == []


def test_a_producer_in_the_registry_is_claimed_refused_and_hinted_at(tmp_path: Path) -> None:
    producers = (*PRODUCERS, TOY)
    command = ["python", "toy-serve"]
    config = LaunchConfig(out=str(tmp_path / "run.h5"), plugins=())
    assert launch.plugins_for(config, command, (), producers) == (__name__,)
    assert launch.plugins_for(config, command, (), PRODUCERS) == ()
    claimed = LaunchConfig(out=str(tmp_path / "run.h5"), plugins=(__name__,))
    with pytest.raises(InputError, match="toy serves only with --eager"):
        launch.check(claimed, command, producers)
    launch.check(claimed, [*command, "--eager"], producers)
    launch.check(claimed, command, PRODUCERS)  # a producer that is not registered refuses nothing
    assert "the toy server had no requests" in launch.nothing_recorded(claimed, producers)
    assert "the toy server had no requests" not in launch.nothing_recorded(claimed, PRODUCERS)


def test_each_importer_of_the_registry_is_a_cli_command(tmp_path: Path, monkeypatch) -> None:
    import tracediff.cli as tracediff_cli

    commands = typer.main.get_command(tracediff_cli.app).commands["import"].commands  # type: ignore[attr-defined]
    assert set(commands) == {i.command for p in PRODUCERS for i in p.importers} == {"sglang-dump",
                                                                                   "specforge-ckpt"}
    monkeypatch.setattr(tracediff_cli.import_app, "registered_commands",
                        list(tracediff_cli.import_app.registered_commands))  # the toy's leaves with the test
    tracediff_cli.add_importer(TOY.importers[0])
    done = cli("import", "toy-dump", "--out", str(tmp_path / "t.h5"))
    assert done.returncode == 0 and done.stdout.strip() == f"wrote {tmp_path / 't.h5'}"
    bad = cli("import", "toy-dump", "--out", str(tmp_path / "t.arrow"))
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"error: {tmp_path / 't.arrow'}: the output must end in .h5"


@pytest.mark.subprocess
def test_the_cli_starts_without_any_producer_library() -> None:
    done = run_python("import sys, tracediff.cli; "
                      "print(sorted(m for m in ('torch', 'sglang', 'specforge') if m in sys.modules))")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
