"""A name map's entries must name tensors the traces hold, on both sides: an entry from a name b
lacks (``zzz = target.aux``) is refused with one line, as one moving a shared name to a name a lacks
is, instead of matching nothing and then naming ``--name-b zzz`` in the next-step hint."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import tracediff as td
from tests.conftest import cli


def pair(tmp_path: Path) -> tuple[str, str]:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    for side, name in (("a", "target.aux"), ("b", "their.aux")):
        with td.record(tmp_path / f"{side}.h5", source="serving") as rec:
            rec.log(name, x + (side == "b"), token_ids=np.arange(4))
    return str(tmp_path / "a.h5"), str(tmp_path / "b.h5")


def test_a_map_file_entry_naming_a_tensor_b_lacks_is_refused(tmp_path) -> None:
    a, b = pair(tmp_path)
    (tmp_path / "m.txt").write_text("zzz = target.aux\n")
    done = cli("compare", a, b, "--map-file", str(tmp_path / "m.txt"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr == "error: --map: 'zzz'='target.aux': b has no tensor named 'zzz': the map would " \
                          "match nothing\n"


def test_a_mistyped_name_of_b_gets_a_suggestion(tmp_path) -> None:
    a, b = pair(tmp_path)
    done = cli("compare", a, b, "--map", "their.auz=target.aux")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "b has no tensor named 'their.auz' (did you mean 'their.aux'?)" in done.stderr


def test_a_map_of_names_b_holds_compares(tmp_path) -> None:
    a, b = pair(tmp_path)
    done = cli("compare", a, b, "--map", "their.aux=target.aux", "--json")
    assert done.returncode == 1, done.stderr  # b's values differ: compared, and diverged
