"""At interpreter exit the recorder's exit fence runs before h5py's own exit handler.

h5py's handler calls into HDF5, which two threads may never be in at once; run beside a writer still
inside an HDF5 write (a host exiting with a busy writer, one Ctrl-C), it crashed the host (SIGSEGV).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# A host importing tracediff, not h5py (tracediff imports it on opening an HDF5 trace); at exit it
# says whether h5py's converters, which h5py's exit handler unregisters, are still there when the
# fence starts. Its first recorder writes the format given, its second HDF5.
HOST = """
import sys
import numpy as np
import tracediff as td
for path in sys.argv[1:]:
    with td.record(path) as rec:
        rec.log("h", np.zeros((1, 4), np.float32), token_ids=[0])
import h5py
from h5py import h5t
vlen = h5t.py_create(h5py.string_dtype(), logical=True)
def watch(frame, event, arg):
    if event == "call" and frame.f_code.co_qualname == "Writers.fence":
        there = h5t.find(vlen, h5t.PYTHON_OBJECT) is not None
        print("at the fence, h5py's exit handler", "has not run" if there else "has run", flush=True)
sys.setprofile(watch)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("first", ["h5", "arrow"])
def test_the_exit_fence_runs_before_h5pys_exit_handler(tmp_path, first) -> None:
    """Exit handlers run last registered first: the fence, registered when tracediff is imported,
    ran after h5py's, registered later, when the first HDF5 trace was opened. A host sent one Ctrl-C
    while exiting with a busy writer (close()'s join interrupted) had h5py's handler unregister its
    type converters while the writer was inside an HDF5 write, and died of SIGSEGV (1 run in 99;
    "error in writer: RuntimeError: Failed to extract top-level error description", then "Fatal
    Python error: Segmentation fault"). Now the fence is registered again at the first writer's
    start, after h5py's handler, and runs first: the writer is out of HDF5 when h5py's handler runs."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    paths = [str(tmp_path / f"first.{first}"), str(tmp_path / "second.h5")]
    proc = subprocess.run([sys.executable, "-c", HOST, *paths], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["at the fence, h5py's exit handler has not run"], proc.stdout
