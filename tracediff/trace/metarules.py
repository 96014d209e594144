"""What trace metadata may hold: one home for the rules readers enforce and the recorder keeps.

A reader refuses metadata over ``MAX_META_BYTES``, nested deeper than ``MAX_DEPTH``, of more than
``MAX_META_VALUES`` JSON values or holding a string that is not valid Unicode (a lone surrogate, as
``sys.argv`` paths can hold); the recorder checks what it is given against the same rules, so that
what it writes always reads.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

MAX_META_BYTES = 16 << 20  # run or final metadata; real ones are a few KiB
MAX_DEPTH = 32  # nesting of metadata JSON (contracts nest 3 or 4 deep)
# JSON values (containers, members, elements) in one metadata text; real ones hold a few hundred. 16 MiB
# of ``[]`` would parse into 5.6M lists (0.75 GB, seconds): the text is measured before it is parsed.
MAX_META_VALUES = 1 << 20

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a JSON text spells a (lone) surrogate
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def valid_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def clean_text(text: str) -> str:
    """``text`` with each lone surrogate written as a visible escape (``\\udce9``)."""
    return text if valid_text(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _bare(raw: bytes) -> bytes:
    return _STRING.sub(b'""', raw) if b'"' in raw else raw


def value_count(raw: bytes) -> int:
    """How many JSON values a reader counts in a JSON text (containers, members, elements), from
    its brackets and separators outside strings: the measure ``MAX_META_VALUES`` bounds."""
    bare = _bare(raw)
    return bare.count(b"[") + bare.count(b"{") + bare.count(b",") + bare.count(b":")


def text_problem(raw: bytes) -> str | None:
    """What a reader would refuse in a JSON text by its shape alone: more than ``MAX_META_VALUES``
    values, or nesting deeper than ``MAX_DEPTH``; from passes over the bytes in C (strings left out),
    before any tree is built, so a hostile text costs its own size and milliseconds."""
    bare = _bare(raw)
    opening = bare.count(b"[") + bare.count(b"{")
    if opening + bare.count(b",") + bare.count(b":") > MAX_META_VALUES:
        return f"more than {MAX_META_VALUES} JSON values"
    if opening > MAX_DEPTH:
        brackets = np.frombuffer(bare.translate(None, _NOT_BRACKETS), dtype=np.uint8)
        steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
        if int(np.cumsum(steps).max(initial=0)) > MAX_DEPTH:
            return f"JSON nested more than {MAX_DEPTH} deep"
    return None


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether a JSON text (valid UTF-8) can decode to a string holding a surrogate: only through a
    ``\\uD800``-``\\uDFFF`` escape (a pair of them is one valid character; the tree tells)."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def tree_problem(value: Any, depth: int = 1) -> str | None:
    """What a reader would refuse in a JSON tree (``depth``: the level ``value`` sits at), or None."""
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            return f"JSON nested more than {MAX_DEPTH} deep"
        for child in [*node.keys(), *node.values()] if isinstance(node, dict) else node:
            if isinstance(child, str):
                if not valid_text(child):
                    return "a string that is not valid Unicode"
            elif isinstance(child, (dict, list, tuple)):
                stack.append((child, level + 1))
    return None


def too_deep(value: Any, depth: int) -> bool:
    """Whether ``value`` at level ``depth`` nests deeper than a reader takes (lists, tuples, dicts)."""
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if level > MAX_DEPTH:
                return True
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def clean_tree(value: Any) -> tuple[Any, bool]:
    """``value`` with every string (keys too) made valid Unicode; and whether anything changed.
    Call on trees already known to be within MAX_DEPTH."""
    if isinstance(value, str):
        out = clean_text(value)
        return out, out is not value
    if isinstance(value, dict):
        changed, tree = False, {}
        for key, child in value.items():
            new_key, c1 = clean_tree(key) if isinstance(key, str) else (key, False)
            new_child, c2 = clean_tree(child)
            tree[new_key] = new_child
            changed = changed or c1 or c2
        return (tree, True) if changed else (value, False)
    if isinstance(value, (list, tuple)):
        pairs = [clean_tree(child) for child in value]
        if any(c for _, c in pairs):
            return [v for v, _ in pairs], True
        return value, False
    return value, False


__all__ = ["MAX_DEPTH", "MAX_META_BYTES", "MAX_META_VALUES", "clean_text", "clean_tree",
           "may_hold_surrogates", "text_problem", "value_count", "too_deep", "tree_problem", "valid_text"]
