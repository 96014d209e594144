"""``--aux-convention sglang``: a draft's aux layer ids, read as SGLang reads them for one target.

The ids go through the target family's own ``set_eagle3_layers_to_capture`` (conventions.py: SGLang's
code where it imports, else its table) and come back as the states each slot holds, in SGLang's
concatenation order: an AuxSpec that replay can rebuild from the target states a trace recorded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tracediff.eagle3.capture import OUTPUT_OF_LAYER, AuxSpec
from tracediff.eagle3.conventions import capture_refusal, labels, layer_of, sglang_selection


@dataclass(frozen=True)
class TargetShape:
    """What SGLang's reading of the ids depends on: the served class and its layer count."""

    architecture: str
    num_layers: int


def target_shape(contract: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> TargetShape | None:
    """The target's architecture and layer count: from a trace's contract (the class SGLang served,
    or the target config a producer stated), else from a checkpoint's config.json; None if neither."""
    stated = contract.get("target_config") or {}
    model_class = contract.get("target_model_class")
    architecture = model_class.rsplit(".", 1)[-1] if isinstance(model_class, str) \
        else stated.get("architecture")
    layers = contract.get("target_num_layers") or stated.get("num_hidden_layers")
    if (architecture is None or layers is None) and config is not None:
        text = config.get("text_config") or config
        architecture = architecture or (config.get("architectures") or [None])[0]
        layers = layers or text.get("num_hidden_layers")
    if not isinstance(architecture, str) or not isinstance(layers, int):
        return None
    return TargetShape(architecture, layers)


def sglang_aux(ids: Sequence[int], target: TargetShape) -> AuxSpec:
    """The states SGLang feeds the draft for ``ids`` on ``target``; ValueError when SGLang refuses
    the ids, the family captures what no trace records (a layer's branch output), or it is unknown."""
    try:
        selection = sglang_selection(target.architecture, list(ids), target.num_layers)
    except LookupError as exc:
        raise ValueError(str(exc)) from None
    refusal = capture_refusal(selection)
    if refusal is not None:
        raise ValueError(refusal)
    if any(state.endswith(".branch") for state in selection.states):
        raise ValueError(f"SGLang's {target.architecture} feeds layer branch outputs "
                         f"{labels(selection.states)}, which a trace does not record")
    return AuxSpec(tuple(layer_of(state) for state in selection.states), convention=OUTPUT_OF_LAYER)
