"""Name mappings for traces from other producers: ``--map NAME_IN_B=NAME_IN_A`` and mapping files.

A mapping file is either a JSON object {"name in b": "name in a"} or lines ``NAME_IN_B = NAME_IN_A``
with ``#`` comments, so that one file per producer can be kept next to its hooks.
"""

from __future__ import annotations

import json
from pathlib import Path

from tracediff.errors import InputError, did_you_mean

MAX_FILE_BYTES = 64 << 20  # far beyond any list of names; a larger file is not a mapping file
SHOWN = 80  # characters of a bad line quoted in an error


def parse_pair(item: str) -> tuple[str, str]:
    """'NAME_IN_B=NAME_IN_A' -> (name in b, name in a); ValueError when malformed."""
    name_b, sep, name_a = item.partition("=")
    name_b, name_a = name_b.strip(), name_a.strip()
    if not sep or not name_b or not name_a or "=" in name_a:
        shown = item if len(item) <= SHOWN else item[: SHOWN - 3] + "..."
        raise ValueError(f"expected NAME_IN_B=NAME_IN_A, got {shown!r}")
    return name_b, name_a


def read_mapping_file(path: Path) -> dict[str, str]:
    """The mapping in ``path`` (either form); ``InputError`` with one line for anything else."""
    try:
        if path.exists() and not path.is_file():  # a FIFO would block the read, a directory fail it
            raise InputError(path, "not a regular file: not a mapping file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise InputError(path, f"over {MAX_FILE_BYTES >> 20} MiB: not a mapping file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(path, "no such mapping file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(path, f"cannot read the mapping file: {exc}") from None
    if text.lstrip().startswith("{"):
        try:
            pairs = json.loads(text, object_pairs_hook=list)
        except json.JSONDecodeError as exc:
            raise InputError(path, f"not valid JSON: {exc.msg} at line {exc.lineno}") from None
        except RecursionError:  # the parser recurses per level: a hostile file must not take it down
            raise InputError(path, "JSON nested too deeply (a mapping file is one flat object of "
                                   "strings)") from None
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], str) and p[0] and p[1]
                   for p in pairs):
            raise InputError(path, 'expected a JSON object of {"name in b": "name in a"} strings')
        return _once(path, [(name_b, name_a) for name_b, name_a in pairs])
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            entries.append(parse_pair(line))
        except ValueError as exc:
            raise InputError(path, f"line {number}: {exc}") from None
    return _once(path, entries)


def _once(path: Path, entries: list[tuple[str, str]]) -> dict[str, str]:
    """The entries as a mapping; a name of b mapped twice is an error, not a silent last-one-wins."""
    mapping: dict[str, str] = {}
    for name_b, name_a in entries:
        if name_b in mapping:
            raise InputError(path, f"{name_b!r} is mapped twice")
        mapping[name_b] = name_a
    return mapping


def renamed(names: list[str], rename: dict[str, str], names_a: list[str]) -> dict[str, str]:
    """Each of b's ``names`` -> the name it is compared under. Two of b's tensors under one name, or
    a map that moves a name both traces hold to one a lacks (a typo), would hide a tensor from the
    compare: that is an error, not a silent choice; so is a map from a name b lacks (a typo that
    would match nothing, and then name in hints a tensor b does not hold)."""
    held = set(names)
    for name, target in rename.items():
        if name not in held:
            hint = did_you_mean(name, names)
            raise InputError("--map", f"{name!r}={target!r}: b has no tensor named {name!r}"
                                      + (f" ({hint})" if hint else "") + ": the map would match nothing")
    out = {name: rename.get(name, name) for name in names}
    for name, target in out.items():
        if name in names_a and target not in names_a:
            hint = did_you_mean(target, names_a)
            raise InputError("--map", f"{name!r}={target!r}: both traces hold {name!r} and a has no tensor "
                                      f"named {target!r}" + (f" ({hint})" if hint else "")
                                      + f": the map would hide {name!r} from the compare")
    seen: dict[str, str] = {}
    for name, target in out.items():
        if target in seen:
            raise InputError("--map", f"{seen[target]!r} and {name!r} of b would both be compared as "
                                      f"{target!r}: map one of them to another name")
        seen[target] = name
    return out
