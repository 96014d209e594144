"""The README's Layout section is the tree: every path it lists exists, and every folder of Python
code under tracediff/ and testbed/ is listed; the shipped package never imports the test bed."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

CODE_ROOTS = ("tracediff", "testbed")


def listed() -> list[str]:
    """The paths the Layout block names: the first word of each line that starts one."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"^## Layout\n+```\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no fenced Layout block"
    return [line.split()[0] for line in block.group(1).splitlines() if line and not line[0].isspace()]


def code_folders() -> set[str]:
    return {str(p.parent.relative_to(REPO)) + "/" for root in CODE_ROOTS for p in (REPO / root).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_every_listed_path_exists() -> None:
    paths = listed()
    assert paths and [p for p in paths if not (REPO / p).exists()] == []


def test_every_folder_of_code_is_listed() -> None:
    assert sorted(code_folders() - set(listed())) == []


def test_the_package_never_imports_the_test_bed() -> None:
    importers = []
    for path in (REPO / "tracediff").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "testbed" or n.startswith("testbed.") for n in names):
                importers.append(str(path.relative_to(REPO)))
    assert importers == []
