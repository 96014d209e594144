"""A host that exits while its recorder's writer is abandoned mid-write ends with its own exit code.

The abandoned writer still runs as the interpreter finalizes; it must hold no torch object then:
freeing one there ended the thread inside C++ code and the host died of SIGABRT (exit 134).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

# gzip makes a write slow enough (a 128 MiB batch: seconds) for close_timeout and the grace to pass
# mid-write; hundreds of 256 KiB torch records leave many for the writer to free at exit
HOST = """
import sys
import torch
import tracediff as td

rec = td.record(sys.argv[1], queue_bytes=1 << 30, compression="gzip", on_full="block", close_timeout=0.1,
                flush_bytes=128 << 20)
x = torch.randn(64, 1024)
for i in range(600):
    rec.log("a", x + i, step=i, request="r", token_ids=torch.arange(64))
if sys.argv[2] == "close":
    rec.close()
print("host done", flush=True)
sys.exit(int(sys.argv[3]))
"""


def test_host_exits_with_its_own_code_when_a_busy_writer_of_torch_tensors_is_abandoned(tmp_path):
    # the abort was a race (about 3 runs in 4 on the code before): two hosts at once, one closing
    # explicitly, one leaving it to interpreter exit
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [("close", "0"), ("exit", "3")]
    hosts = [subprocess.Popen([sys.executable, "-c", HOST, str(tmp_path / f"t{k}.h5"), how, code], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, (how, code) in enumerate(runs)]
    for (how, code), host in zip(runs, hosts):
        out, err = host.communicate(timeout=120)
        assert "host done" in out
        assert "terminate called" not in err, err
        assert host.returncode == int(code), (how, host.returncode, err)
        assert "abandoned" in err  # the case under test: the writer was still busy at close
