"""Start-up: ``import tracediff`` and ``tracediff --help`` load none of the heavy modules (numpy,
pyarrow, h5py, torch): the recorder, the reader and compare load on first use, and the
package's public names still resolve to the functions and classes (``td.record`` is the function,
not the ``tracediff.record`` subpackage, whatever was imported first). What it costs in time is
measured by scripts/bench_startup.py, never asserted here."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.subprocess
# typer.rich_utils: rich's help rendering (rich.markdown, pygments: 0.1 s); the help is plain text
HEAVY = ("numpy", "pyarrow", "h5py", "torch", "typer.rich_utils")
LOADED = f"import json, sys; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"


@pytest.mark.parametrize("code", [
    "import tracediff",
    "import sys; from tracediff.cli import main; sys.argv = ['tracediff', '--help']\n"
    "try:\n    main()\nexcept SystemExit:\n    pass",
    "import tracediff.integrations.registry",
])
def test_starting_loads_no_heavy_module(code) -> None:
    done = run_python(f"{code}\n{LOADED}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_public_names_resolve_whatever_was_imported_first() -> None:
    done = run_python("import tracediff.record.recorder, tracediff.integrations.sglang.hooks\n"
                      "import tracediff as td, inspect\n"
                      "from tracediff.integrations.sglang import install\n"
                      "from tracediff.trace import Trace\n"
                      "print(inspect.isfunction(td.record), inspect.isclass(td.Recorder),"
                      " inspect.isfunction(install), td.Trace is Trace, callable(td.compare),"
                      " callable(td.open_trace))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"] * 6


def test_a_trace_loads_only_its_own_format(tmp_path) -> None:
    """The storage registry declares the built-in formats; each format's module (h5py, pyarrow)
    loads when a trace of that format is read or written, not before; reading and comparing Arrow
    traces never loads pyarrow's compute kernels (0.13 s of imports)."""
    from tests.conftest import REPO

    sample = REPO / "traces" / "eagle3" / "serving.h5"
    arrow = tmp_path / "serving.arrow"
    convert = run_python(f"import tracediff.trace.convert as c; c.convert({str(sample)!r}, {str(arrow)!r})")
    assert convert.returncode == 0, convert.stderr
    probe = ("import sys, tracediff as td\nwith td.open_trace(sys.argv[1]) as t:\n"
             "    t.rows('target.token')\n"
             "td.compare(sys.argv[1], sys.argv[1])\n"
             "print(sorted(m for m in ('h5py', 'pyarrow', 'tracediff.trace.h5', 'tracediff.trace.arrow',"
             " 'pyarrow.compute') if m in sys.modules))")
    on_arrow, on_h5 = run_python(probe, str(arrow)), run_python(probe, str(sample))
    assert on_arrow.returncode == 0 and on_h5.returncode == 0, on_arrow.stderr + on_h5.stderr
    assert on_arrow.stdout.split("\n")[-2] == "['pyarrow', 'tracediff.trace.arrow']"
    assert on_h5.stdout.split("\n")[-2] == "['h5py', 'tracediff.trace.h5']"


def test_a_small_compare_loads_only_what_it_uses() -> None:
    """The sample's compare (two HDF5 traces, a few MB): h5py, never pyarrow, torch or the compiled
    kernels (numpy measures inputs this small); its verdict is still the sample's."""
    from tests.conftest import REPO

    traces = REPO / "traces" / "eagle3"
    done = run_python("import sys\nfrom tracediff.entry import main\n"
                      f"sys.argv = ['tracediff', 'compare', {str(traces / 'training.h5')!r}, "
                      f"{str(traces / 'serving.h5')!r}, '--json']\n"
                      "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
                      "print(code, sorted(m for m in ('h5py', 'pyarrow', 'torch', 'tracediff.diff.kernels')"
                      " if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    code, loaded = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert json.loads(done.stdout[: done.stdout.rindex("}") + 1])["verdict"] == "match" and code == "0"
    assert loaded == "['h5py']"
