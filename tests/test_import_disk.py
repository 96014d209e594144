"""An importer is no host: its recorder keeps no disk room free, so a small import fits where the
output does, and one that does not fit is one ``error:`` line naming the user's output (never the
hidden staging file) with the system's reason (``File too large``, ``No space left on device``),
leaving nothing behind. A host's recorder still stops short of the limit, and says which limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_python

torch = pytest.importorskip("torch")

LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from tracediff.cli import main
sys.argv = ["tracediff", *sys.argv[2:]]
main()
"""


def features(tmp_path: Path) -> Path:
    """Three SpecForge feature files: a ~95 KB training trace."""
    folder = tmp_path / "features"
    folder.mkdir()
    for i in range(3):
        n = 40
        torch.save({"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
                    "aux_hidden_state": torch.randn(1, n, 96), "hidden_state": torch.randn(1, n, 32)},
                   folder / f"data_{i}.ckpt")
    return folder


@pytest.mark.subprocess
def test_an_import_under_the_limit_is_written_whole(tmp_path) -> None:
    source, out = features(tmp_path), tmp_path / "small" / "i.h5"
    out.parent.mkdir()
    done = run_python(LIMITED, str(2 << 20), "import", "specforge-ckpt", str(source), "-o", str(out))
    assert done.returncode == 0, done.stderr  # 2 MiB is far below the host recorder's 8 MiB reserve
    assert done.stderr == "" and [p.name for p in out.parent.iterdir()] == ["i.h5"]


@pytest.mark.subprocess
def test_an_import_past_the_limit_is_one_line_naming_the_output(tmp_path) -> None:
    source, out = features(tmp_path), tmp_path / "small" / "i.h5"
    out.parent.mkdir()
    done = run_python(LIMITED, "20000", "import", "specforge-ckpt", str(source), "-o", str(out))
    assert done.returncode == 2
    assert done.stderr == f"error: {out}: cannot write: File too large\n", done.stderr
    assert list(out.parent.iterdir()) == []  # no staging directory, no half trace


HOST = """
import resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
import tracediff as td
with td.record(sys.argv[1], source="serving") as rec:
    rec.log("target.h", np.ones((4, 8), np.float32), token_ids=np.arange(4))
print(rec.stopped)
"""


@pytest.mark.subprocess
def test_a_host_recorder_names_the_file_size_limit_it_stops_at(tmp_path) -> None:
    done = run_python(HOST, str(tmp_path / "run.h5"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("file size limit (RLIMIT_FSIZE 1048576 bytes) nearly reached"), done.stdout
    assert "disk nearly full" not in done.stderr
