"""``--aux-convention sglang``: a draft's aux layer ids, read as SGLang reads them for one target.

The ids go through the target family's own ``set_eagle3_layers_to_capture`` (conventions.py: SGLang's
code where it imports, else its table) and come back as the states each slot holds, in SGLang's
concatenation order: an AuxSpec that replay can rebuild from the target states a trace recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

from tracediff.eagle3.capture import OUTPUT_OF_LAYER, AuxSpec
from tracediff.eagle3.conventions import labels, layer_of, sglang_selection, usable_selection
from tracediff.integrations.target_summary import TargetShape


def sglang_aux(ids: Sequence[int], target: TargetShape) -> AuxSpec:
    """The states SGLang feeds the draft for ``ids`` on ``target``; ValueError when SGLang refuses
    the ids, the family captures what no trace records (a layer's branch output), or it is unknown."""
    selection = usable_selection(sglang_selection, target.architecture, ids, target.num_layers)
    if any(state.endswith(".branch") for state in selection.states):
        raise ValueError(f"SGLang's {target.architecture} feeds layer branch outputs "
                         f"{labels(selection.states)}, which a trace does not record")
    return AuxSpec(tuple(layer_of(state) for state in selection.states), convention=OUTPUT_OF_LAYER)
