"""File names the user or a trace gave are data: an error line or a recorder warning shows a terminal
escape or a newline in one as an escape, so it can neither drive the terminal nor forge a second
``error:`` line."""

from __future__ import annotations

import logging
import shutil

import tracediff as td
from tests.conftest import REPO, cli

ESC = "x\x1b[2J\x1b]0;PWNED\x07.h5"


def test_an_error_line_shows_an_escape_in_a_path_as_text(tmp_path) -> None:
    out = tmp_path / ESC
    shutil.copy(REPO / "traces" / "eagle3" / "training.h5", out)
    refused = cli("convert", str(REPO / "traces" / "eagle3" / "training.h5"), str(out))
    assert refused.returncode == 2
    assert "\x1b" not in refused.stderr and "\x07" not in refused.stderr
    assert refused.stderr.splitlines() == [f"error: {tmp_path}/x\\x1b[2J\\x1b]0;PWNED\\x07.h5: exists: pass "
                                           "--force to replace it (nothing was written)"]


def test_a_newline_in_a_path_cannot_forge_a_second_error_line(tmp_path) -> None:
    shown = cli("show", str(tmp_path / "nope\nerror: forged.h5"))
    assert shown.returncode == 2 and len(shown.stderr.splitlines()) == 1
    assert "nope\\nerror: forged.h5" in shown.stderr


def test_a_recorder_warning_shows_an_escape_in_its_path_as_text(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        with td.record(tmp_path / "missing\x1b[31m" / "t.h5"):
            pass
    messages = [r.getMessage() for r in caplog.records]
    assert messages and all("\x1b" not in m for m in messages)
    assert any("missing\\x1b[31m" in m for m in messages)


def test_the_next_command_writes_an_escape_in_a_path_as_an_escape_that_pastes(tmp_path) -> None:
    """compare's ``next:`` line keeps a path with a terminal escape, ANSI-C quoted: it prints as data,
    and the shell reads it back as the very path (run here: it shows the diverging row)."""
    import subprocess

    samples = REPO / "traces" / "eagle3"
    serving = tmp_path / ESC
    shutil.copy(samples / "serving_aux_bug.h5", serving)
    compared = cli("compare", str(samples / "training.h5"), str(serving))
    assert compared.returncode == 1 and "\x1b" not in compared.stdout and "\x07" not in compared.stdout
    line = compared.stdout.strip().splitlines()[-1]
    assert line.startswith("next: tracediff show ")
    assert f"$'{tmp_path}/x\\x1b[2J\\x1b]0;PWNED\\x07.h5'" in line, line
    argv = subprocess.run(["bash", "-c", 'printf "%s\\0" ' + line.removeprefix("next: tracediff ")],
                          capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    assert argv[2] == str(serving)
    shown = cli(*argv)
    assert shown.returncode == 0, shown.stderr


def test_a_shell_word_reads_back_the_same_bytes_in_any_locale() -> None:
    """Format characters (U+2028, U+202E, a zero-width space) are written as their UTF-8 bytes: bash
    reads ``\\u`` escapes only in a UTF-8 locale, ``\\x`` ones in any (CI and containers run LC_ALL=C)."""
    import os
    import subprocess

    from tracediff.report.compare import shell_word

    for text in ("x\x1b[2J\x07y", "caf\udce9.h5", "a\u2028b", "a\u202eb", "zw\u200bsp", "\u00e9\x01",
                 "it's\x01\\"):
        word = shell_word(text)
        assert word.isprintable() and word.isascii() or "\u00e9" in text, word
        for locale in ("C", "C.UTF-8"):
            got = subprocess.run(["bash", "-c", "printf %s " + word], capture_output=True, check=True,
                                 env={**os.environ, "LC_ALL": locale}).stdout
            assert got == text.encode("utf-8", "surrogateescape"), (text, word, locale)
