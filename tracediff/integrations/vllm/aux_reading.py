"""``--aux-convention vllm``: a draft's aux layer ids, read as vLLM 0.32 reads them for one target.

vLLM hands the ids to the target as given: id k is the residual stream entering layer k (0: the
embeddings), each boundary captured once, in ascending order; what a target class's forward reaches
and raises is tracediff's table of vllm 0.32.0 (``conventions.vllm_selection``, kept true by running
vLLM's own code). The answer is an AuxSpec that replay can rebuild from the target states a trace
recorded, as SGLang's reading is (``integrations/sglang/aux_reading.py``; both find the target with
``target_summary.target_shape``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tracediff.eagle3.capture import INPUT_TO_LAYER, AuxSpec
from tracediff.eagle3.conventions import usable_selection, vllm_selection
from tracediff.integrations.target_summary import TargetShape, target_shape


def vllm_aux(ids: Sequence[int], target: TargetShape) -> AuxSpec:
    """The states vLLM 0.32 feeds the draft for ``ids`` on ``target`` (no ids: the target's default
    [2, L//2, L-3]); ValueError when vLLM refuses the ids or the target, when an id selects nothing (the
    aux a slot short), or when tracediff's table does not know the class."""
    selection = usable_selection(vllm_selection, target.architecture, ids, target.num_layers)
    return AuxSpec(selection.captured, convention=INPUT_TO_LAYER, ascending=True)


def reads_aux(contract: Mapping[str, Any], config: Mapping[str, Any] | None,
              ids: Sequence[int]) -> AuxSpec | None:
    """A draft's aux ids as vLLM 0.32 feeds them on the target the contract (or its config) names;
    None when neither says the target's architecture and layer count. ValueError for bad ids."""
    shape = target_shape(contract, config)
    return None if shape is None else vllm_aux(ids, shape)
