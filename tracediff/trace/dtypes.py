"""Lossless dtype codec: every tensor is stored as raw bits plus a dtype tag.

numpy has no bfloat16, so a bfloat16 tensor is kept as its raw 16 bits (uint16) and the tag
``bfloat16``; nothing is ever rounded through another type. Upcasting to float32 is exact.
"""

from __future__ import annotations

import numpy as np

# tag -> numpy dtype used to hold the raw bits on disk and in memory
STORAGE: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}

FLOAT_TAGS = frozenset({"float64", "float32", "float16", "bfloat16"})


def storage_dtype(tag: str) -> np.dtype:
    """The numpy dtype that holds the raw bits of ``tag`` (little-endian on disk)."""
    try:
        return STORAGE[tag]
    except KeyError:
        raise ValueError(f"unknown dtype tag {tag!r}; known: {', '.join(STORAGE)}") from None


def tag_of(dtype: np.dtype) -> str:
    """The tag of a numpy dtype (numpy arrays cannot be bfloat16, so never returns it)."""
    dtype = np.dtype(dtype)
    for tag, storage in STORAGE.items():
        if tag != "bfloat16" and storage == dtype:
            return tag
    raise ValueError(f"dtype {dtype} cannot be recorded; supported: {', '.join(STORAGE)}")


def decode(raw: np.ndarray, tag: str) -> np.ndarray:
    """Values as numpy can hold them: bfloat16 becomes float32 (exactly), others unchanged."""
    if tag == "bfloat16":
        wide = np.empty(raw.shape, dtype=np.uint32)
        np.left_shift(raw, 16, out=wide, dtype=np.uint32)
        return wide.view(np.float32)
    return raw


def raw_to_torch(raw: np.ndarray, tag: str):
    """The exact torch tensor for raw bits of ``tag`` (a copy; bfloat16 included)."""
    import torch

    raw = np.array(raw, dtype=storage_dtype(tag), copy=True)
    if tag == "bfloat16":
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)
