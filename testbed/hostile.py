"""Hostile draft checkpoints and traces: the committed sample draft (traces/eagle3/draft) with one
thing made hostile (a config that lies about a size, a FIFO or a device where a file belongs,
non-finite weights, a link loop), and a sample trace that states a chain no input can hold.

tests/test_hostile_checkpoints.py and scripts/bench_hostile_checkpoints.py build the same ones, and
run the real CLI on them alike (``run_capped``: its own process, a time limit, a memory cap).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "traces" / "eagle3"
SAMPLE_DRAFT = SAMPLES / "draft"
CONFIG, WEIGHTS = "config.json", "model.safetensors"


def config_edit(**changes: object) -> Callable[[Path], None]:
    """config.json with ``changes``: a size the weights do not have."""
    def edit(draft: Path) -> None:
        path = draft / CONFIG
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))
    return edit


def _linked(name: str, to: str) -> Callable[[Path], None]:
    """``name`` a symbolic link to ``to`` (a device; the link itself, for a loop)."""
    def edit(draft: Path) -> None:
        (draft / name).unlink()
        (draft / name).symlink_to(draft / name if to == "itself" else to)
    return edit


def _fifo(name: str) -> Callable[[Path], None]:
    def edit(draft: Path) -> None:
        (draft / name).unlink()
        os.mkfifo(draft / name)
    return edit


def _nonfinite(key: str, value: float) -> Callable[[Path], None]:
    """``key``'s first row (a 2-D weight) or first element set to ``value`` (NaN or inf)."""
    def edit(draft: Path) -> None:
        from safetensors.torch import load_file, save_file

        weights = load_file(draft / WEIGHTS)
        weights[key][0] = value
        save_file(weights, draft / WEIGHTS)
    return edit


HOSTILE: dict[str, Callable[[Path], None]] = {
    "hidden_size 65536": config_edit(hidden_size=65536),
    "vocab_size 2^24": config_edit(vocab_size=1 << 24),
    "head_dim 2^20": config_edit(head_dim=1 << 20),
    "config.json is /dev/zero": _linked(CONFIG, "/dev/zero"),
    "config.json is a FIFO": _fifo(CONFIG),
    "model.safetensors is a FIFO": _fifo(WEIGHTS),
    "model.safetensors is a link loop": _linked(WEIGHTS, "itself"),
    "NaN in lm_head.weight": _nonfinite("lm_head.weight", float("nan")),
    "inf in fc.weight": _nonfinite("fc.weight", float("inf")),
}


def hostile_draft(name: str, path: Path) -> Path:
    """The sample draft copied to ``path`` with ``HOSTILE[name]`` applied; ``path``."""
    shutil.copytree(SAMPLE_DRAFT, path)
    HOSTILE[name](path)
    return path


def with_num_steps(source: Path, path: Path, num_steps: int) -> Path:
    """A copy of ``source`` (a serving .h5 trace) whose contract states ``speculative_args.num_steps``
    ``num_steps``: its metadata attribute rewritten, with its checksum, as the writer writes them."""
    import h5py

    from tracediff.trace.crc import crc32

    shutil.copy(source, path)
    with h5py.File(path, "r+") as f:
        meta = json.loads(f.attrs["meta"])
        stated = meta["contract"]["speculative_args"]
        meta["contract"]["speculative_args"] = {**stated, "num_steps": num_steps}
        text = json.dumps(meta)
        f.attrs["meta"] = text
        f.attrs["meta_crc32"] = np.int64(crc32(text.encode()))
    return path


# the console entry point (.venv/bin/tracediff's) in this interpreter, wherever the package is installed
ENTRY = (sys.executable, "-c", "from tracediff.entry import main; main()")
CAPPED = Path(__file__).with_name("capped_exec.py")  # sets the cap, then becomes the program
SHOWN = 150  # characters of a stderr line kept
SUITE_ONLY = ("TORCHDYNAMO_DISABLE",)  # tests/conftest.py's, not a user's: a run gets the user's environment


@dataclass(frozen=True)
class Capped:
    """One capped run of the real CLI: its exit code ("timeout" when killed at the limit), seconds,
    peak RSS (MB, the child's own), stderr lines, and what it left in its $TMPDIR."""

    exit: int | str
    seconds: float
    peak_rss_mb: float
    stderr: list[str]
    tmp_left: list[str]

    @property
    def first_line(self) -> str:
        """stderr's first line (and a traceback's last)."""
        lines = self.stderr
        shown = lines[0][:SHOWN] if lines else ""
        traceback = shown.startswith("Traceback") and len(lines) > 1
        return shown + (" ... " + lines[-1][:SHOWN] if traceback else "")


def run_capped(args: list[str], work: Path, limit: float = 60.0, cap: int = 4 << 30,
               program: Sequence[str] = ENTRY) -> Capped:
    """``tracediff ARGS`` (``program``) as its own process, in a fresh empty $TMPDIR under ``work``,
    killed after ``limit`` seconds, its address space capped at ``cap`` bytes (a run that would take
    the machine's memory fails instead); its peak RSS as ``capped_exec.py`` measured it (0 when
    killed)."""
    tmp = Path(tempfile.mkdtemp(prefix="tmp.", dir=work))
    peak = tmp.parent / f"{tmp.name}.peak"
    env = {**{k: v for k, v in os.environ.items() if k not in SUITE_ONLY}, "TMPDIR": str(tmp),
           "COLUMNS": "200", "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    with tempfile.TemporaryFile(dir=work) as err:
        start = time.monotonic()
        child = subprocess.Popen([sys.executable, str(CAPPED), str(cap), str(peak), *program, *args],
                                 stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)  # its own group: a kill reaches the program too
        code: int | str = "timeout"
        try:
            child.wait(timeout=limit)
            code = child.returncode
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the group this run started
            child.wait()
        seconds = time.monotonic() - start
        err.seek(0)
        lines = err.read().decode("utf-8", "replace").splitlines()
    left = sorted(p.name for p in tmp.iterdir())
    shutil.rmtree(tmp, ignore_errors=True)
    kib = int(peak.read_text()) if peak.exists() else 0
    peak.unlink(missing_ok=True)
    return Capped(code, round(seconds, 2), round(kib / 1024, 1), lines, left)
