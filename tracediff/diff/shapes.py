"""Tensors whose two sides differ in layout or dtype. Rows of other shapes cannot be compared: says
so with the likely cause, instead of failing every row with numbers that mean nothing. Dtypes that
differ never stop a comparison (rows compare by value, ``metrics``), but are always said."""

from __future__ import annotations

from tracediff.diff.pair import Pair
from tracediff.diff.results import Status
from tracediff.eagle3.names import DRAFT_D2T, DRAFT_FC_IN, DRAFT_T2D, TARGET_AUX
from tracediff.trace.dtypes import FLOAT_TAGS

CONCATENATED = (TARGET_AUX, DRAFT_FC_IN)
VOCAB_MAPS = {DRAFT_D2T: "draft", DRAFT_T2D: "target"}  # one entry per draft id / per target id


def mismatch(name: str, shapes: Pair[tuple[int, ...]]) -> tuple[Status, str] | None:
    """(status, note) when the two sides' rows of ``name`` cannot be compared, else None."""
    if shapes.a != shapes.b:
        cause = likely_cause(name, shapes)
        return "shape_mismatch", f"row shape {list(shapes.a)} vs {list(shapes.b)}: {cause}"
    return None


def kinds_differ(dtypes: tuple[str, str]) -> bool:
    """An integer (or bool) tensor on one side, a float one on the other: a ``dtype_mismatch``."""
    return (dtypes[0] in FLOAT_TAGS) != (dtypes[1] in FLOAT_TAGS)


def dtype_note(dtypes: tuple[str, str]) -> str:
    """'' for one dtype on both sides; else what differs and how the rows were compared. Floats of
    other precision compare in the wider (the looser one's default bounds), integers of other
    widths exactly, an integer side against a float one as float64 values."""
    a, b = dtypes
    if a == b:
        return ""
    if kinds_differ(dtypes):  # the status says dtype_mismatch
        return (f"{a} vs {b}: an integer tensor on one side, a float one on the other (a cast, or "
                "another tensor under this name?), compared by value as float64")
    if a in FLOAT_TAGS:
        wide = "float64" if "float64" in dtypes else "float32"  # as ``metrics`` widens them
        return f"dtypes differ: {a} vs {b} (compared by value, in {wide})"
    return f"dtypes differ: {a} vs {b} (compared by value, exactly)"


def agreement(rows: int, failed: int) -> str:
    """How the values of a ``dtype_mismatch`` tensor compared, for its note."""
    if not rows:
        return "no row compared"
    counted = f"{rows} row{'' if rows == 1 else 's'} compared"
    return f"the values agree ({counted})" if not failed else f"the values differ in {failed} of {counted}"


def likely_cause(name: str, shapes: Pair[tuple[int, ...]]) -> str:
    """The usual reasons two producers' rows of one tensor differ in shape."""
    if len(shapes.a) != len(shapes.b) or shapes.a[:-1] != shapes.b[:-1] or not shapes.a:
        return "the tensors are laid out differently (other rank or leading dims)"
    wide, narrow = sorted((shapes.a[-1], shapes.b[-1]), reverse=True)
    if name in VOCAB_MAPS:
        return f"vocab maps of another {VOCAB_MAPS[name]} vocab size ({shapes.a[-1]} vs {shapes.b[-1]} ids)"
    if name.endswith("logits"):
        return ("logits over different vocabularies (draft vocab vs target vocab) or a tensor-parallel "
                "vocab shard")
    shard = narrow > 0 and wide % narrow == 0
    if name in CONCATENATED:
        return "a different number of concatenated aux layers" + (
            f" or a tensor-parallel shard (1/{wide // narrow} of the row)" if shard else "")
    if shard:
        return f"a tensor-parallel shard (1/{wide // narrow} of the row)"
    return "another hidden size (a different model?)"
