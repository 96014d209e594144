"""Tensors that cannot be compared row by row: row shapes or kinds of dtype differ. Says so with
the likely cause, instead of failing every row with numbers that mean nothing."""

from __future__ import annotations

from tracediff.diff.pair import Pair
from tracediff.diff.results import Status
from tracediff.trace.dtypes import FLOAT_TAGS

CONCATENATED = ("target.aux", "draft.fc_in")


def mismatch(name: str, dtypes: Pair[str], shapes: Pair[tuple[int, ...]]) -> tuple[Status, str] | None:
    """(status, note) when the two sides' rows of ``name`` cannot be compared, else None. Floats of
    different precision compare (in the wider one); integers compare with integers."""
    if shapes.a != shapes.b:
        cause = likely_cause(name, shapes)
        return "shape_mismatch", f"row shape {list(shapes.a)} vs {list(shapes.b)}: {cause}"
    if (dtypes.a in FLOAT_TAGS) != (dtypes.b in FLOAT_TAGS):
        return "dtype_mismatch", f"{dtypes.a} vs {dtypes.b}: a float tensor on one side, an integer one on " \
                                 "the other (another tensor under this name?)"
    return None


def likely_cause(name: str, shapes: Pair[tuple[int, ...]]) -> str:
    """The usual reasons two producers' rows of one tensor differ in shape."""
    if len(shapes.a) != len(shapes.b) or shapes.a[:-1] != shapes.b[:-1] or not shapes.a:
        return "the tensors are laid out differently (other rank or leading dims)"
    wide, narrow = sorted((shapes.a[-1], shapes.b[-1]), reverse=True)
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
