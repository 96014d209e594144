"""Reading other producers' ``torch.save`` files without unpickling them: ``torch.load`` with
``weights_only=True`` only, and its refusals said in a few plain words (torch's own messages span
lines, hold terminal escapes and advise re-running with ``weights_only=False``, which we never do).
File names the importers discover are data: ``names_as_data`` shows their control characters as escapes."""

from __future__ import annotations

import functools
import re
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, ParamSpec, TypeVar

from tracediff.errors import InputError
from tracediff.text import safe

P = ParamSpec("P")
R = TypeVar("R")


def names_as_data(run: Callable[P, R]) -> Callable[P, R]:
    """``run`` with the file and the problem of any ``InputError`` it raises shown as data
    (``tracediff.text.safe``): a dump file named with terminal escapes, C1 controls or a lone surrogate
    prints them as escapes in the error line, and never clears or retitles the user's terminal."""

    @functools.wraps(run)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return run(*args, **kwargs)
        except InputError as exc:
            raise type(exc)(safe(exc.path), safe(exc.problem)) from None

    return wrapped


def load_tensors(path: Path, what: str, source: IO[bytes] | None = None) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` (or of ``source``, read from it); anything it
    refuses or cannot read is an ``InputError`` naming ``path``: "not <what> ...: <why>". A file in
    torch.save's zip container is checked against its entries' CRC-32s first (torch reads them
    unchecked: a flipped byte would load as a different tensor)."""
    import torch

    check_zip_crcs(path, source)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns on legacy formats: the error line says enough
            return torch.load(path if source is None else source, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, foreign, or objects weights_only refuses to unpickle
        raise InputError(path, f"not {what} torch.load(weights_only=True) reads: {refusal(exc)}") from None


def check_zip_crcs(path: Path, source: IO[bytes] | None = None) -> None:
    """Refuse a zip container (torch.save's format since torch 1.6) whose entries fail the CRC-32
    each stores. Anything else, a zip too damaged to list included, is left to torch.load to judge."""
    try:
        handle = open(path, "rb") if source is None else source
    except OSError:
        return  # torch.load says why it cannot be read
    try:
        start = handle.tell()
        if handle.read(4) != b"PK\x03\x04":
            return
        handle.seek(start)
        with zipfile.ZipFile(handle) as archive:
            bad = archive.testzip()
    except (NotImplementedError, RuntimeError) as exc:  # a directory naming an unknown method, flags
        raise InputError(path, f"corrupt: its zip directory is damaged ({refusal(exc)})") from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error):
        bad = None
    finally:
        if source is None:
            handle.close()
        else:
            source.seek(start)
    if bad is not None:
        raise InputError(path, f"corrupt: its entry {bad} fails its CRC-32")


def refusal(exc: Exception) -> str:
    """Why torch.load refused, in a few plain words."""
    text = str(exc)
    lowered = text.lower()
    if "unsupported global" in lowered:  # a pickled object: weights_only names the class it would build
        return "it holds Python objects other than tensors, which would need unpickling (refused, never run)"
    if "zip archive" in lowered:
        return "truncated, or not a torch.save file"
    if isinstance(exc, OSError):  # the file itself: permissions, a directory, an I/O error
        first = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text.strip().splitlines()[0] if text.strip() else "")
        return "".join(c for c in first if c.isprintable())[:200] or type(exc).__name__
    return "not a torch.save file (or a damaged one)"  # random bytes, .npy, text: the unpickler's guesses
