"""Every command that writes refuses an existing output unless ``--force``, never replaces anything but
a regular file that is none of its inputs (no link, dangling or not, no FIFO, device or directory),
and leaves its output whole or not at all: a corrupt input, a full disk or Ctrl-C leave nothing."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

import tracediff as td
from tests.conftest import cli, run_python
from tracediff.trace.output import staged_output, staged_outputs, staging_dirs

MARK = 1234.5  # the value of every tensor element: its bytes are found (and corrupted) in the file


def write(path: Path, records: int = 4, width: int = 64) -> Path:
    with td.record(path, source="serving") as rec:
        for step in range(records):
            rec.log("target.h", np.full((4, width), MARK, np.float32), step=step, request="r",
                    positions=np.arange(4), token_ids=np.arange(4))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def only_line(stderr: str, path: Path, problem: str) -> None:
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith(f"error: {path}: {problem}"), stderr


def left(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.fixture
def a(tmp_path: Path, fmt: str) -> Path:
    return write(tmp_path / f"a.{fmt}")


@pytest.fixture
def b(tmp_path: Path, fmt: str) -> Path:
    return write(tmp_path / f"b.{fmt}")


# ---- compare --html ----------------------------------------------------------------------------------

def test_html_over_a_compared_trace_is_refused_even_with_force(a, b) -> None:
    before = digest(b)
    for extra in ([], ["--force"]):
        done = cli("compare", str(a), str(b), "--html", str(b), *extra)
        assert done.returncode == 2
        only_line(done.stderr, b, "output would overwrite the input")
        assert digest(b) == before


def test_html_over_an_existing_file_needs_force(a, b, tmp_path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("mine")
    done = cli("compare", str(a), str(b), "--html", str(notes))
    assert done.returncode == 2 and notes.read_text() == "mine"
    only_line(done.stderr, notes, "exists: pass --force to replace it")
    done = cli("compare", str(a), str(b), "--html", str(notes), "--force")
    assert done.returncode == 0, done.stderr
    assert notes.read_text().startswith("<!DOCTYPE html>") and not staging_dirs(tmp_path)


@pytest.mark.parametrize("fmt", ["h5"])
@pytest.mark.parametrize("kind", ["fifo", "symlink", "dangling", "chardev", "directory"])
def test_html_never_replaces_what_is_not_a_regular_file(a, b, tmp_path, kind) -> None:
    path = tmp_path / "report.html"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to("/proc/self/fd/1")
    elif kind == "dangling":
        path.symlink_to(tmp_path / "created.html")
    elif kind == "directory":
        path.mkdir()
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
        except PermissionError:
            pytest.skip("creating a device needs root")
    before = os.lstat(path)
    done = cli("compare", str(a), str(b), "--html", str(path), "--force")
    assert done.returncode == 2, done.stdout
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: {path}: is ")
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert not (tmp_path / "created.html").exists() and not staging_dirs(tmp_path)


# ---- convert -----------------------------------------------------------------------------------------

def test_convert_never_overwrites_a_trace_unasked(a, b, tmp_path) -> None:
    before = digest(b)
    done = cli("convert", str(a), str(b))
    assert done.returncode == 2 and digest(b) == before
    only_line(done.stderr, b, "exists: pass --force to replace it")
    done = cli("convert", str(a), str(b), "--force")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {b}\n"
    with td.open_trace(b) as trace:
        assert len(trace.index) == 4


def test_convert_onto_a_hard_link_of_its_input_is_refused_even_with_force(b, tmp_path) -> None:
    alias = tmp_path / "alias.h5"
    os.link(b, alias)
    before = digest(b)
    for extra in ([], ["--force"]):
        done = cli("convert", str(b), str(alias), *extra)
        assert done.returncode == 2
        only_line(done.stderr, alias, "output would overwrite the input")
        assert digest(b) == before and os.stat(b).st_nlink == 2


def corrupt_last_record(path: Path) -> None:
    """Flip one byte of the last tensor's data (the checksum catches it when that record is read)."""
    data = bytearray(path.read_bytes())
    mark = np.float32(MARK).tobytes() * 4
    at = data.rfind(mark)
    assert at > 0
    data[at + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_failed_convert_leaves_no_output(a, tmp_path, fmt) -> None:
    corrupt_last_record(a)
    out = tmp_path / ("out.arrow" if fmt == "h5" else "out.h5")
    done = cli("convert", str(a), str(out))
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: {a}: ")
    assert left(tmp_path) == {a.name}


@pytest.mark.parametrize("name", ["x[/bold].arrow", "[bold]y.arrow", "z\x1b[2J.arrow"])
def test_file_names_are_printed_as_data(b, tmp_path, name) -> None:
    (tmp_path / "x[").mkdir()  # 'x[/bold].arrow' is a file in the directory 'x['
    done = cli("convert", str(b), str(tmp_path / name))
    assert done.returncode == 0, done.stderr
    shown = str(tmp_path / name).replace("\x1b", "\\x1b")
    assert done.stdout == f"wrote {shown}\n"
    assert (tmp_path / name).is_file()


# ---- slice, import, bundle, record: dangling links and existing files ---------------------------------

@pytest.mark.parametrize("fmt", ["arrow"])
def test_a_dangling_link_as_slice_output_is_not_written_through(b, tmp_path) -> None:
    out = tmp_path / "s.arrow"
    out.symlink_to(tmp_path / "elsewhere.arrow")
    for extra in ([], ["--force"]):
        done = cli("slice", str(b), "-o", str(out), "--steps", "0", *extra)
        assert done.returncode == 2
        only_line(done.stderr, out, "is a symbolic link (dangling)")
    assert not (tmp_path / "elsewhere.arrow").exists() and out.is_symlink()


@pytest.mark.parametrize("fmt", ["h5"])
def test_slice_replaces_a_regular_file_with_force(b, tmp_path) -> None:
    out = tmp_path / "s.h5"
    out.write_bytes(b"old")
    done = cli("slice", str(b), "-o", str(out), "--steps", "0", "--force")
    assert done.returncode == 0, done.stderr
    with td.open_trace(out) as trace:
        assert len(trace.index) == 1
    assert not staging_dirs(tmp_path)


def test_a_dangling_link_as_import_output_is_not_written_through(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    features = tmp_path / "features"
    features.mkdir()
    torch.save({"input_ids": torch.arange(3), "loss_mask": torch.ones(3, dtype=torch.long),
                "aux_hidden_state": torch.zeros(1, 3, 12), "hidden_state": torch.zeros(1, 3, 4)},
               features / "data_0.ckpt")
    out = tmp_path / "train.h5"
    out.symlink_to(tmp_path / "made.h5")
    done = cli("import", "specforge-ckpt", str(features), "-o", str(out), "--force")
    assert done.returncode == 2
    only_line(done.stderr, out, "is a symbolic link (dangling)")
    assert not (tmp_path / "made.h5").exists()
    real = tmp_path / "real.h5"
    real.write_bytes(b"old")
    assert cli("import", "specforge-ckpt", str(features), "-o", str(real)).returncode == 2
    done = cli("import", "specforge-ckpt", str(features), "-o", str(real), "--force")
    assert done.returncode == 0, done.stderr
    with td.open_trace(real) as trace:
        assert "target.aux" in trace.names()
    assert not staging_dirs(tmp_path)


@pytest.mark.parametrize("fmt", ["h5"])
def test_bundle_never_writes_through_a_link(a, b, tmp_path) -> None:
    out = tmp_path / "bug"
    zipped = tmp_path / "bug.zip"
    zipped.symlink_to(tmp_path / "made.zip")
    done = cli("bundle", str(a), str(b), "-o", str(out), "--zip", "--force")
    assert done.returncode == 2
    only_line(done.stderr, zipped, "is a symbolic link (dangling)")
    assert not out.exists() and not (tmp_path / "made.zip").exists()
    zipped.unlink()
    (tmp_path / "empty").mkdir()
    out.symlink_to(tmp_path / "empty")
    done = cli("bundle", str(a), str(b), "-o", str(out))
    assert done.returncode == 2
    only_line(done.stderr, out, "is a symbolic link")
    assert not any((tmp_path / "empty").iterdir()) and not staging_dirs(tmp_path)


def test_record_out_refuses_a_dangling_link_even_with_force(tmp_path) -> None:
    out = tmp_path / "run.h5"
    out.symlink_to(tmp_path / "made.h5")
    done = cli("record", "--out", str(out), "--force", "--watch", "model.*", "--", sys.executable, "-c", "0")
    assert done.returncode == 2
    only_line(done.stderr, out, "is a symbolic link (dangling)")
    assert not (tmp_path / "made.h5").exists()


@pytest.mark.parametrize("command", ["convert", "record"])
def test_an_unwritable_output_directory_is_refused_before_any_work(b, command) -> None:
    """`record --out` into a read-only directory ran the command, recorded nothing and exited 0
    blaming the --watch globs; every writer now refuses it up front. /proc/self is one that no
    process, root included, may create files in."""
    out = Path("/proc/self/run.h5")
    args = ([str(b), str(out)] if command == "convert"
            else ["--out", str(out), "--watch", "model.*", "--", sys.executable, "-c", "0"])
    done = cli(command, *args)
    assert done.returncode == 2
    only_line(done.stderr, out, "output directory /proc/self is not writable")


# ---- whole or nothing: a full disk, Ctrl-C ------------------------------------------------------------

FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
from tracediff.cli import main
sys.argv = ["tracediff", *sys.argv[1:]]
main()
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("command", ["convert", "slice"])
def test_a_full_disk_is_one_error_line_and_leaves_no_file(tmp_path, fmt, command) -> None:
    src = write(tmp_path / f"big.{fmt}", records=8, width=4096)  # 512 KiB of tensors
    out = tmp_path / f"out.{'arrow' if fmt == 'h5' else 'h5'}"
    args = [str(src), str(out)] if command == "convert" else [str(src), "-o", str(out)]
    done = run_python(FULL_DISK, command, *args)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {out}: cannot write: File too large"), done.stderr
    assert left(tmp_path) == {src.name}


def test_ctrl_c_while_writing_leaves_nothing(tmp_path) -> None:
    out = tmp_path / "page.html"
    with pytest.raises(KeyboardInterrupt), staged_output(out) as staged:
        staged.write_text("half")
        raise KeyboardInterrupt
    assert left(tmp_path) == set()


def test_a_file_that_appears_while_writing_is_never_replaced(tmp_path) -> None:
    out = tmp_path / "page.html"
    with pytest.raises(td.InputError, match="exists: pass --force"), staged_output(out) as staged:
        staged.write_text("mine")
        out.write_text("theirs")
    assert out.read_text() == "theirs" and left(tmp_path) == {"page.html"}


@pytest.mark.parametrize("failure", ["a directory appears at the second output", "Ctrl-C"])
def test_a_forced_publish_failing_half_way_puts_back_what_it_replaced(tmp_path, failure) -> None:
    """Two outputs replaced under --force: when the second cannot be published, the first is the
    file it replaced again (same bytes, same inode), and nothing new is left."""
    first, second = tmp_path / "out.rank0.h5", tmp_path / "out.rank1.h5"
    first.write_text("old first")
    second.write_text("old second")
    inode = first.stat().st_ino
    interrupted = KeyboardInterrupt if failure == "Ctrl-C" else td.InputError
    real_replace = os.replace

    def replace(src, dst):  # the second replacement fails as the failure says
        if Path(dst) == second:
            if failure == "Ctrl-C":
                raise KeyboardInterrupt
            second.unlink()
            second.mkdir()
        return real_replace(src, dst)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "replace", replace)
        with pytest.raises(interrupted), staged_outputs([first, second], force=True) as staging:
            (staging / first.name).write_text("new first")
            (staging / second.name).write_text("new second")
    assert first.read_text() == "old first" and first.stat().st_ino == inode
    assert not staging_dirs(tmp_path)
    if failure == "Ctrl-C":
        assert second.read_text() == "old second"


def test_every_rank_output_is_checked_before_any_is_written(tmp_path, fmt) -> None:
    for rank in (0, 1):
        with td.record(tmp_path / f"src.{fmt}", source="serving", rank=rank, world_size=2) as rec:
            rec.log("target.h", np.ones((1, 4), np.float32), request="r", positions=[0], token_ids=[1])
    taken = tmp_path / f"out.rank1.{fmt}"
    taken.write_bytes(b"mine")
    for command in (["convert", str(tmp_path / f"src.{fmt}"), str(tmp_path / f"out.{fmt}")],
                    ["slice", str(tmp_path / f"src.{fmt}"), "-o", str(tmp_path / f"out.{fmt}")]):
        done = cli(*command)
        assert done.returncode == 2
        only_line(done.stderr, taken, "exists: pass --force to replace it")
        assert not (tmp_path / f"out.rank0.{fmt}").exists() and taken.read_bytes() == b"mine"
    done = cli("convert", str(tmp_path / f"src.{fmt}"), str(tmp_path / f"out.{fmt}"), "--force")
    assert done.returncode == 0, done.stderr
    with td.open_trace(tmp_path / f"out.{fmt}") as trace:
        assert len(trace.files) == 2
    assert not staging_dirs(tmp_path)


@pytest.mark.subprocess
def test_record_out_replaces_a_regular_trace_only_with_force(tmp_path) -> None:
    out = write(tmp_path / "run.h5")
    before = digest(out)
    command = ["record", "--out", str(out), "--watch", "model.*", "--", sys.executable, "-c", "0"]
    done = cli(*command)
    assert done.returncode == 2 and digest(out) == before
    only_line(done.stderr, out, "already exists: choose another --out, or pass --force")
    done = cli(*command[:3], "--force", *command[3:])
    assert done.returncode == 0, done.stderr
    assert not out.exists() or digest(out) != before  # the old trace is gone (the child recorded nothing)
