"""The package's floors: a module imports only from its own floor or the floors below it.

The floors, lowest first (README's Layout section lists them with what each holds):

- ground: the shared utilities every floor may use (errors, lazy loading, the version, interrupts,
  text as data, the JSON codec, sizes);
- trace: the trace format, generic (no EAGLE-3 name);
- record: the recorder and the launcher;
- eagle3: EAGLE-3's facts and model (names, versions, conventions, readings, the draft, checkpoints);
- diff: the compare engine;
- integrations: the producers;
- tools: one library call per command (compare, replay), each returning one typed result;
- report: renderers;
- bundle: the bug-report bundle;
- the front doors: the package root, the CLI and its entry point.

An import inside ``if TYPE_CHECKING:`` is for annotations only and does not count; an import inside a
function does (it runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tracediff"
GROUND = ("errors", "lazy", "version", "interrupts", "text", "jsonio", "sizes")
FLOORS = [GROUND, ("trace",), ("record",), ("eagle3",), ("diff",), ("integrations",), ("tools",),
          ("report",), ("bundle",), ("", "cli", "entry", "__main__")]
# imports that still run up a floor, each to be moved (issue 38); an entry that no longer exists fails
# the test, so the list only shrinks
PENDING: set[tuple[str, str]] = set()


def floor_of(module: str) -> int:
    """The floor of ``tracediff.X...`` by its first part after the package."""
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else ""
    for level, rooms in enumerate(FLOORS):
        if room in rooms:
            return level
    raise AssertionError(f"{module}: on no floor (add its room to FLOORS and to README's Layout)")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module_level: bool = False) -> set[str]:
    """The tracediff modules a file imports at run time (``from tracediff import x``: tracediff.x when x
    is a module of the package); ``module_level``: those its body imports, not its functions."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out: set[str] = set()
    for node in (tree.body if module_level else ast.walk(tree)):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "tracediff")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "tracediff":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (PACKAGE.parent / Path(*sub.split("."))).is_dir()
                out.add(sub if is_module else node.module)
    return out


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = module_name(path)
        for other in imports(path):
            if floor_of(other) > floor_of(mine):
                found.add((mine, other))
    return found


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    found = upward_imports()
    assert found - PENDING == set(), sorted(found - PENDING)
    assert PENDING - found == set(), f"moved already, drop from PENDING: {sorted(PENDING - found)}"


def test_every_room_of_the_package_is_on_a_floor() -> None:
    rooms = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir()
             if not p.name.startswith((".", "__pycache__")) and (p.is_dir() or p.suffix == ".py")}
    placed = {room for floor in FLOORS for room in floor} | {"__init__"}
    assert rooms <= placed, sorted(rooms - placed)


def test_the_floors_see_what_they_should() -> None:
    """The walker itself: a run-time import counts, an annotation-only one does not."""
    assert floor_of("tracediff.trace.reader") < floor_of("tracediff.tools.compare") < floor_of(
        "tracediff.cli")
    assert "tracediff.tools.compare" in imports(PACKAGE / "cli.py")  # inside a function: it runs
    assert not any(m.startswith("tracediff.record") for m in imports(PACKAGE / "trace" / "reader.py"))


def test_no_circle_of_module_level_imports() -> None:
    """Module-level imports form no circle (an import inside a function, run when called, may close one)."""
    graph = {module_name(p): imports(p, module_level=True) for p in PACKAGE.rglob("*.py")}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for other in sorted(graph.get(module, ())):
            if seen.get(other) == 1:
                raise AssertionError(" -> ".join([*path[path.index(other):], other]))
            if other in graph and other not in seen:
                visit(other, [*path, other])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])


def test_the_layout_lists_the_rooms_floor_by_floor() -> None:
    """README's Layout block names the rooms in the floors' order."""
    from tests.test_layout import listed

    rooms = [path.split("/")[1] for path in listed() if path.startswith("tracediff/") and path.count("/") >= 2
             and path.split("/")[1]]
    order = [floor_of(f"tracediff.{room}") for room in dict.fromkeys(rooms)]
    assert order == sorted(order), list(dict.fromkeys(rooms))


def test_the_commands_stay_thin() -> None:
    """No function of the CLI or of tools/ runs over 60 lines: a command parses, calls one library
    function and renders; the work lives below."""
    long = []
    for path in [PACKAGE / "cli.py", *sorted((PACKAGE / "tools").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno is not None and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
