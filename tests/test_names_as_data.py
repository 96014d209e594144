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
