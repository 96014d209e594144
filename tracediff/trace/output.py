"""Where every command writes its outputs: never over what the user did not ask to replace, and
whole or not at all. ``check_outputs`` refuses a taken path up front; ``staged_outputs`` writes into
a hidden directory beside the targets and publishes each file with one link or rename on success.

The rule (every writing command: convert, slice, bundle, import, compare --html, record --out): a
path that exists is refused with one line unless the user passes ``--force``, and even then only a
regular file is replaced: never a device, FIFO, socket, directory or symbolic link (a dangling one
included: writing through it would create the file it names), nor a file that is (a hard link to)
one of the command's inputs (same device and inode). A directory output (a bundle) may be an empty
directory. Outputs are written into ``.NAME.PID.XXXXXXXX.tracediff-tmp/`` in the target's directory (one a
killed writer left is removed by the next command writing there), under
their own names (so suffixes, rank names and zip stems read as the target's), and published when the
writing succeeded: a new name by ``os.link`` (atomic, never over a file that appeared meanwhile), an
existing regular file under ``--force`` by ``os.replace``. On any failure, a full disk or Ctrl-C
included, the hidden directory is removed and nothing appears (a file replaced before the failure
is put back); an ``OSError`` becomes one
``InputError`` line naming the output."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tracediff import interrupts
from tracediff.errors import InputError

STAGING_SUFFIX = ".tracediff-tmp"
# .NAME.PID.XXXXXXXX.tracediff-tmp: the pid tells a staging directory whose writer died (SIGKILL,
# a crash) from one in use; the next command that writes into that directory removes the dead ones
_STAGING = re.compile(r"^\..*\.(\d+)\.[A-Za-z0-9_]+" + re.escape(STAGING_SUFFIX) + "$")
NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def identities(inputs: Iterable[str | Path]) -> set[tuple[int, int]]:
    """(device, inode) of each input that exists, links followed: the files no output may replace."""
    found = set()
    for path in inputs:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            continue
        found.add((st.st_dev, st.st_ino))
    return found


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_directory(path: Path) -> None:
    """InputError unless ``path``'s directory exists and this process may create files in it (a
    read-only file system or directory is refused before any work, not found out at the end)."""
    parent = path.parent
    if not parent.is_dir():
        raise InputError(path, f"output directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(path, f"output directory {parent} is not writable")


def check_output(path: str | Path, inputs: Iterable[str | Path] = (), force: bool = False, *,
                 directory: bool = False) -> None:
    """InputError (one line) unless ``path`` may be written: it does not exist, or under ``force`` it
    is a regular file that is none of ``inputs``; with ``directory`` (an output that is a directory)
    it may also be an empty directory, never anything else. Its parent must be a directory."""
    path = Path(path)
    check_directory(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise InputError(path, f"cannot write: {reason(exc)}") from None
    if stat.S_ISLNK(st.st_mode):
        dangling = not os.path.exists(path)
        raise InputError(path, f"is a symbolic link{' (dangling)' if dangling else ''}: an output is never "
                               "written through a link nor replaces one, even with --force (choose another "
                               "name)")
    if (st.st_dev, st.st_ino) in identities(inputs):
        raise InputError(path, "output would overwrite the input")
    if directory:
        if stat.S_ISDIR(st.st_mode):
            try:
                empty = not any(os.scandir(path))
            except OSError as exc:
                raise InputError(path, f"cannot write: {reason(exc)}") from None
            if empty:
                return
            raise InputError(path, "exists and is not an empty directory: it is never replaced, even with "
                                   "--force (choose a new directory)")
        what = "a file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
        raise InputError(path, f"exists and is {what}: the output is a new directory (choose another name)")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(path, f"is {_kind(st.st_mode)}: an output replaces only a regular file, even with "
                               "--force (choose another name)")
    if not force:
        raise InputError(path, "exists: pass --force to replace it (nothing was written)")


def check_outputs(paths: Sequence[str | Path], inputs: Iterable[str | Path] = (), force: bool = False, *,
                  directories: Iterable[str | Path] = ()) -> None:
    """``check_output`` for each of ``paths`` (those in ``directories`` as directory outputs), all before
    anything is written."""
    inputs = list(inputs)
    dirs = {Path(d) for d in directories}
    for path in paths:
        check_output(path, inputs, force, directory=Path(path) in dirs)


def reason(exc: BaseException) -> str:
    """One line for an OSError: its strerror, or the errno that HDF5 or Arrow put in the message."""
    text = str(exc)
    found = re.search(r"errno\s*=\s*(\d+)", text)  # HDF5's message holds the system's errno
    if found and int(found.group(1)) > 0:
        return os.strerror(int(found.group(1)))
    if isinstance(exc, OSError) and exc.strerror and "\n" not in exc.strerror:
        return exc.strerror
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0:
        return os.strerror(code)
    for named in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO, errno.EACCES):
        if os.strerror(named).lower() in text.lower():
            return os.strerror(named)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


@contextmanager
def staged_outputs(paths: Sequence[str | Path], inputs: Iterable[str | Path] = (), force: bool = False, *,
                   directories: Iterable[str | Path] = ()) -> Iterator[Path]:
    """A hidden staging directory beside ``paths`` (which share one directory): write each output into
    it under its own name (``staging / path.name``); on a clean exit each one written there is published
    at its path (one not written is skipped), the targets checked again first. On any exception the
    staging directory goes and nothing is published; an OSError becomes an InputError naming the
    output. All ``paths`` are checked before the block runs (``check_outputs``)."""
    targets = [Path(p) for p in paths]
    if not targets:
        raise ValueError("staged_outputs needs at least one path")
    parent = targets[0].parent
    if any(t.parent != parent for t in targets):
        raise ValueError("staged outputs share one directory")
    inputs = list(inputs)
    dirs = {Path(d) for d in directories}
    check_outputs(targets, inputs, force, directories=dirs)
    try:
        staging = _new_staging(targets[0].name, parent)
    except OSError as exc:
        raise InputError(targets[0], f"cannot write: {reason(exc)}") from None
    try:
        try:
            yield staging
        except OSError as exc:  # e.g. the disk filled up while writing
            raise InputError(targets[0], f"cannot write: {reason(exc)} (nothing was written)") from None
        except InputError as exc:  # one naming a staged file names the output instead
            raise _renamed(exc, staging, parent) from None
        interrupts.check()  # a Ctrl-C swallowed while writing (in a callback) still publishes nothing
        _publish(staging, targets, inputs, force, dirs)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def staged_output(path: str | Path, inputs: Iterable[str | Path] = (), force: bool = False) -> Iterator[Path]:
    """``staged_outputs`` for one file: yields the temporary path to write (same name, staging dir)."""
    path = Path(path)
    with staged_outputs([path], inputs, force) as staging:
        yield staging / path.name


@contextmanager
def staged_directory(path: str | Path, inputs: Iterable[str | Path] = ()) -> Iterator[Path]:
    """A directory output (a bundle) written whole: yields an empty directory to fill, in a staging
    directory beside ``path``; on a clean exit it is renamed to ``path`` (new, or an empty directory:
    then its files are linked into it one by one, never over one that appeared). On any exception
    nothing is published. ``path`` is checked first (``check_output(..., directory=True)``)."""
    path = Path(path)
    check_output(path, inputs, directory=True)
    into = os.path.lexists(path)  # an empty directory: filled in place (it may be the working directory)
    name = path.name if path.name not in ("", ".", "..") else "out"
    try:
        staging = _new_staging(name, path if into else path.parent)
        work = staging / name
        work.mkdir()
    except OSError as exc:
        raise InputError(path, f"cannot write there ({reason(exc)})") from None
    try:
        try:
            yield work
        except OSError as exc:  # e.g. the disk filled up while writing
            raise InputError(path, f"cannot write: {reason(exc)} (nothing was written)") from None
        except InputError as exc:
            raise _renamed(exc, work, path) from None
        interrupts.check()
        if not into:
            try:
                os.rename(work, path)  # never over a file or a directory that filled meanwhile
            except OSError as exc:
                gone = exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)
                raise InputError(path, "exists (it appeared while writing): nothing was written" if gone
                                 else f"cannot write: {reason(exc)} (nothing was written)") from None
        else:
            made: list[tuple[Path, tuple[int, int]]] = []
            try:
                for entry in sorted(work.iterdir()):
                    st = os.lstat(entry)
                    target = path / entry.name
                    try:
                        _link(entry, target)
                    except OSError as exc:
                        raise _not_published(target, exc) from None
                    made.append((target, (st.st_dev, st.st_ino)))
            except BaseException:
                for target, identity in made:
                    _take_back(target, identity)
                raise
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _new_staging(name: str, parent: Path) -> Path:
    """A new staging directory in ``parent`` for an output called ``name``, after removing the
    staging directories there whose writing process is gone."""
    sweep_stale(parent)
    return Path(tempfile.mkdtemp(prefix=f".{name[:80]}.{os.getpid()}.", suffix=STAGING_SUFFIX, dir=parent))


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the staging directories in ``parent`` left by a writer that died (its pid is not a
    live process); returns them. Only our own directories (by name, not links) are touched."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        found = _STAGING.match(entry.name)
        if found is None or int(found.group(1)) == os.getpid() or _alive(int(found.group(1))):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or not a pid we can ask about: leave it be
    return True


def _not_published(target: Path, exc: OSError, hint: str = "") -> InputError:
    """The one line for a publish that failed: a path taken meanwhile (a link's FileExistsError, or
    a rename onto a non-empty directory or a file), or why the write failed."""
    if isinstance(exc, FileExistsError) or exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR,
                                                         errno.EISDIR):
        return InputError(target, f"exists (it appeared while writing): {hint}(nothing was written)"
                          if hint and isinstance(exc, FileExistsError) else
                          "exists (it appeared while writing): nothing was written")
    return InputError(target, f"cannot write: {reason(exc)} (nothing was written)")


def _renamed(exc: InputError, staged: Path, target: Path) -> InputError:
    """``exc`` with the staging path it names replaced by where the output goes."""
    def moved(text: str) -> str:
        return text.replace(f"{staged}{os.sep}", f"{target}{os.sep}").replace(str(staged), str(target))

    if str(staged) not in exc.path and str(staged) not in exc.problem:
        return exc
    return type(exc)(moved(exc.path), moved(exc.problem))


def _publish(staging: Path, targets: list[Path], inputs: list[str | Path], force: bool,
             dirs: set[Path]) -> None:
    """Each staged output in place: checked again, then linked (new), renamed (a directory) or replaced
    (``force``, a regular file). A failure half way (or a Ctrl-C) undoes what was published before
    it: new names are taken back, and a replaced file is put back from the hard link kept to it in
    the staging directory (where the file system has none, a replaced file stays replaced)."""
    made: list[tuple[Path, tuple[int, int]]] = []
    kept: list[tuple[Path, Path, tuple[int, int]]] = []  # (target, the link to its old file, new identity)
    try:
        for target in targets:
            staged = staging / target.name
            try:
                st = os.lstat(staged)
            except FileNotFoundError:
                continue  # not written (e.g. a rank file the slice keeps nothing of)
            check_output(target, inputs, force, directory=target in dirs)
            identity = (st.st_dev, st.st_ino)
            replaced = not stat.S_ISDIR(st.st_mode) and os.path.lexists(target)
            try:
                if stat.S_ISDIR(st.st_mode):
                    os.rename(staged, target)  # onto nothing or an empty directory; never a file
                elif replaced:
                    old = _keep_old(target, staging / f".replaced.{len(kept)}")
                    os.replace(staged, target)  # force: a regular file, none of the inputs (checked)
                    if old is not None:
                        kept.append((target, old, identity))
                else:
                    _link(staged, target)
            except OSError as exc:
                raise _not_published(target, exc, "pass --force to replace it ") from None
            if not replaced:
                made.append((target, identity))
    except BaseException:
        for target, identity in made:
            _take_back(target, identity)
        for target, old, identity in kept:
            _put_back(target, old, identity)
        raise
    if made or kept:
        _fsync_dir(targets[0].parent)


def _keep_old(target: Path, link: Path) -> Path | None:
    """A hard link to the file about to be replaced (so that a publish failing later can put it
    back); None where the file system has no hard links."""
    try:
        os.link(target, link, follow_symlinks=False)
    except OSError:
        return None
    return link


def _put_back(target: Path, old: Path, identity: tuple[int, int]) -> None:
    """The replaced file at ``target`` again (only while the path still names this run's output)."""
    try:
        st = os.lstat(target)
        if (st.st_dev, st.st_ino) == identity:
            os.replace(old, target)
    except OSError:
        pass


def _link(staged: Path, target: Path) -> None:
    """``staged`` at ``target`` without ever replacing a file there: a hard link (then ``staged`` goes
    with the staging directory); a rename after one more look on file systems without hard links."""
    try:
        os.link(staged, target, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in NO_LINKS:
            raise
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
        os.rename(staged, target)


def _take_back(target: Path, identity: tuple[int, int]) -> None:
    """Remove an output published by this run (only while the path still names it)."""
    try:
        st = os.lstat(target)
        if (st.st_dev, st.st_ino) != identity:
            return
        shutil.rmtree(target) if stat.S_ISDIR(st.st_mode) else target.unlink()
    except OSError:
        pass


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def staging_dirs(directory: str | Path) -> list[Path]:
    """The staging directories left in ``directory`` (none after any command ends, killed ones aside)."""
    return sorted(Path(directory).glob(f".*{STAGING_SUFFIX}"))


__all__ = ["check_output", "check_outputs", "identities", "reason", "staged_directory", "staged_output",
           "staged_outputs", "staging_dirs"]


def check_trace_suffix(path: str | Path) -> None:
    """InputError (one line) unless the path's extension names a trace format (before any work)."""
    from tracediff.trace.writer import format_for

    try:
        format_for(path)
    except ValueError as exc:
        raise InputError(path, str(exc).split(": ", 1)[-1]) from None
