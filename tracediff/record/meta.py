"""Run metadata: what a trace says about the run that wrote it (host, versions, rank, filters).

Also this process's rank and world size (one lookup for the recorder and the launcher), per-rank
file names, and contract values made storable as JSON.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.record.copies import is_torch_tensor
from tracediff.record.filters import RecordFilter
from tracediff.trace.metarules import MAX_META_BYTES, MAX_META_VALUES, clean_tree, too_deep, value_count
from tracediff.trace.schema import FORMAT_NAME, FORMAT_VERSION, dumps_meta
from tracediff.version import __version__

logger = logging.getLogger("tracediff")


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else an initialized torch.distributed, else RANK / WORLD_SIZE."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and not (dist.is_available() and dist.is_initialized()):
        dist = None  # imported but not initialized: the environment says
    if rank is None:
        rank = dist.get_rank() if dist is not None else int(os.environ.get("RANK") or 0)
    if world_size is None:
        world_size = dist.get_world_size() if dist is not None else int(os.environ.get("WORLD_SIZE") or 1)
    return int(rank), int(world_size)


def rank_path(path: Path, rank: int, per_rank: bool) -> Path:
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}") if per_rank else path


def json_ready(value: Any) -> Any:
    """Arrays, tensors and numpy scalars in metadata as the lists and numbers JSON holds."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, np.ndarray) or isinstance(value, np.generic) or is_torch_tensor(value):
        return value.tolist()
    return value


CONTRACT_DEPTH = 3  # the level a contract value sits at in run and final metadata (trace.metarules)
META_ROOM = 1 << 20  # of a trace's metadata bytes, kept for what the recorder itself writes
VALUES_ROOM = 1 << 14  # of its JSON values (MAX_META_VALUES), the same


def storable(values: dict, strict: bool, path: Path, taken: dict | None = None) -> dict:
    """The contract values a trace's reader takes (arrays and tensors as lists, lone surrogates in
    strings and keys escaped, with a warning); the others (not JSON, nested too deep, more bytes or
    JSON values than a trace's metadata may hold beside the contract values already ``taken``) are
    left out with a warning naming the trace at ``path``, or raise in strict mode."""
    out: dict = {}
    cleaned = False
    if not isinstance(values, dict):
        if strict:
            raise ValueError(f"metadata must be a dict of contract values, got {type(values).__name__}")
        logger.warning("tracediff: metadata for %s left out: a dict of contract values was expected, got %s",
                       path, type(values).__name__)
        return out
    values = {k if isinstance(k, str) else str(k): v for k, v in values.items()}  # as JSON would write them
    held = dumps_meta(taken).encode() if taken else b""
    budget = MAX_META_BYTES - META_ROOM - len(held)
    values_left = MAX_META_VALUES - VALUES_ROOM - value_count(held)
    for key, value in values.items():
        try:
            if too_deep(value, CONTRACT_DEPTH):
                raise ValueError("nested deeper than a trace's metadata may be")
            plain = json_ready(value)
            if too_deep(plain, CONTRACT_DEPTH):
                raise ValueError("nested deeper than a trace's metadata may be")
            name, changed_key = clean_tree(key) if isinstance(key, str) else (key, False)
            plain, changed = clean_tree(plain)
            text = dumps_meta({name: plain}).encode()
            size, count = len(text), value_count(text)
            if size > budget:
                raise ValueError(f"{size} bytes of JSON, more than the trace's metadata has room for")
            if count > values_left:
                raise ValueError(f"{count} JSON values, more than the trace's metadata has room for")
        except (TypeError, ValueError, RecursionError) as exc:
            if strict:
                raise ValueError(f"contract value {key!r} cannot be stored as JSON: {exc}") from None
            logger.warning("tracediff: contract value %r left out of %s: %s", key, path, exc)
            continue
        budget -= size
        values_left -= count
        cleaned = cleaned or changed or changed_key
        out[name] = plain
    if cleaned:
        logger.warning("tracediff: contract metadata for %s holds strings that are not valid Unicode "
                       "(lone surrogates): written with them escaped (\\udcXX)", path)
    return out


def run_meta(source: str, contract: dict, rank: int, world_size: int, filt: RecordFilter) -> dict:
    """The metadata a trace opens with."""
    torch_info = None
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = torch.cuda.is_available()
        torch_info = {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
        }
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "source": source,
        "producer": "tracediff",
        "producer_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"hostname": socket.gethostname(), "pid": os.getpid(), "python": platform.python_version(),
                 "platform": platform.platform()},
        "torch": torch_info,
        "versions": {name: str(getattr(sys.modules[name], "__version__", "")) for name in
                     ("numpy", "transformers", "sglang", "specforge") if name in sys.modules},
        "rank": rank,
        "world_size": world_size,
        "filters": {"names": list(filt.names), "exclude": list(filt.exclude), "every": filt.every,
                    "requests": sorted(filt.requests) if filt.requests is not None else None},
        "contract": contract,
    }


__all__ = ["json_ready", "rank_and_world", "rank_path", "run_meta", "storable"]
