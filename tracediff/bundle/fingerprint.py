"""The environment each trace was recorded in, as far as its run metadata and contract say: the facts a
maintainer asks for first in a bug report (versions, device, dtype, attention backend, TP size, the
speculative arguments as resolved). What a trace does not state is said to be not recorded, never
guessed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from tracediff.trace.reader import Trace

NOT_RECORDED = "not recorded"

# Fact -> where producers put it, first found wins: ("meta" | "contract", key path).
WHERE: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "source": (("meta", ("source",)), ("contract", ("source",))),
    "producer": (("meta", ("producer",)),),
    "tracediff": (("meta", ("producer_version",)), ("contract", ("versions", "tracediff"))),
    "created": (("meta", ("created",)),),
    "python": (("meta", ("host", "python")),),
    "platform": (("meta", ("host", "platform")),),
    "torch": (("meta", ("torch", "version")), ("contract", ("versions", "torch")),
              ("contract", ("torch_version",))),
    "cuda": (("meta", ("torch", "cuda")),),
    "transformers": (("contract", ("versions", "transformers")), ("meta", ("versions", "transformers"))),
    "sglang": (("contract", ("sglang_version",)), ("contract", ("versions", "sglang")),
               ("meta", ("versions", "sglang"))),
    "specforge": (("contract", ("versions", "specforge")), ("meta", ("versions", "specforge"))),
    "device": (("contract", ("server_args", "device")), ("meta", ("torch", "device"))),
    "dtype": (("contract", ("server_args", "dtype")), ("contract", ("dtypes",))),
    "attention backend": (("contract", ("attention_backend",)),
                          ("contract", ("server_args", "attention_backend"))),
    "TP size": (("contract", ("tp_size",)), ("contract", ("server_args", "tp_size"))),
    "world size": (("meta", ("world_size",)),),
    "speculative arguments": (("contract", ("speculative_args",)),),
    "target model": (("contract", ("target_model",)),),
    "aux layer ids": (("contract", ("aux_layer_ids",)),),
    "aux layer convention": (("contract", ("aux_layer_convention",)),),
    "integration": (("contract", ("producer_integration",)),),
}


@dataclass
class Fingerprint:
    """One side's environment: fact -> value (None: not recorded, shown as ``NOT_RECORDED``), and the
    dtypes its tensors hold."""

    facts: dict[str, Any]
    tensor_dtypes: dict[str, int]  # dtype tag -> tensors recorded in it


def _lookup(sources: dict[str, dict], where: tuple[tuple[str, tuple[str, ...]], ...]) -> Any:
    for source, path in where:
        node: Any = sources[source]
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None and node != "":
            return node
    return None


def fingerprint(trace: Trace) -> Fingerprint:
    """What ``trace`` states about the environment it was recorded in."""
    sources = {"meta": trace.meta, "contract": trace.contract}
    idx = trace.index
    first = {name: dtype for name, dtype in zip(idx.name.tolist(), idx.dtype.tolist())}
    return Fingerprint(facts={fact: _lookup(sources, where) for fact, where in WHERE.items()},
                       tensor_dtypes=dict(Counter(first.values()).most_common()))
