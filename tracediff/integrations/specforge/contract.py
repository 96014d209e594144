"""What a SpecForge training trace states about its run: the contract, and the aux layer ids.

The aux ids are taken as SpecForge resolves them (``aux_spec``): the caller's, else what SpecForge's
own resolver returned in this process (noted by the launcher plugin), else the draft config's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tracediff.eagle3.capture import OUTPUT_OF_LAYER, AuxSpec
from tracediff.eagle3.conventions import SPECFORGE
from tracediff.integrations.draft_summary import draft_config_summary

resolved_aux: list[int] | None = None  # ids SpecForge's resolver returned in this process


class AuxReading(NamedTuple):
    """The aux ids SpecForge trains with, where they came from, and the states they select."""

    ids: tuple[int, ...]
    where: str  # argument / specforge_resolver / draft_config / target_default
    spec: AuxSpec
    by_family: str | None  # the target architecture whose capture read the ids (None: ids + 1 assumed)

    def contract(self) -> dict[str, Any]:
        stated = {**self.spec.to_dict(), "aux_layer_ids": list(self.ids), "aux_layer_ids_from": self.where,
                  "aux_layer_ids_resolved": sorted(self.spec.layer_ids)}
        stated["aux_layer_reading"] = f"specforge {SPECFORGE} through sglang's {self.by_family}" \
            if self.by_family else "output of layer i (the target's family not given)"
        return stated


def contract(model: Any, aux: AuxReading | None) -> dict[str, Any]:
    """The contract of a recording of ``model`` (an ``OnlineEagle3Model``) with these aux ids."""
    from importlib.metadata import version

    config = model.draft_model.config
    stated: dict[str, Any] = {
        "source": "training", "producer_integration": "specforge", "draft_engine": "specforge",
        "ttt_length": int(model.length), "attention_backend": str(model.attention_backend),
        "d2t_sha256": hashlib.sha256(host(model.draft_model.d2t).tobytes()).hexdigest(),
        "draft_config": draft_config_summary(config),
        "d2t_reading": "offset", "draft_input_shift": 1, "draft_position_offset": 0,
        # SpecForge applies fc_norm and has no norm_before_fc: a config asking for it trains without
        "fc_norms_applied": not getattr(config, "norm_before_fc", False),
        "versions": {name: _version(version, name) for name in ("specforge", "torch", "transformers",
                                                                "tracediff")},
    }
    if aux is not None:
        stated.update(aux.contract())
    return stated


def aux_spec(config: Any, explicit: Sequence[int] | None, num_layers: int | None,
             architecture: str | None = None) -> AuxReading | None:
    """SpecForge's aux ids and where they came from, read as the states SpecForge trains on: its
    capture runs the target family's own SGLang ``set_eagle3_layers_to_capture``, so with the
    target's ``architecture`` (and layer count) known the ids mean what that family makes of them
    (DeepSeek keeps ids not starting at 1: [2, 3, 4] trains on layers 1, 2, 3); without it they are
    read as most families read them, the output of decoder layer i, packed ascending."""
    eagle = getattr(config, "eagle_config", None) or {}
    found: list[tuple[Any, str]] = [(explicit, "argument"), (resolved_aux, "specforge_resolver"),
                                    (eagle.get("eagle_aux_hidden_state_layer_ids"), "draft_config")]
    if num_layers is not None:
        found.append(([1, num_layers // 2 - 1, num_layers - 4], "target_default"))
    for ids, where in found:
        if ids is not None:
            ids = tuple(int(i) for i in ids)
            by_family = _family_reading(ids, num_layers, architecture)
            if by_family is not None:
                return AuxReading(ids, where, by_family, architecture)
            return AuxReading(ids, where, AuxSpec(ids, convention=OUTPUT_OF_LAYER, ascending=True), None)
    return None


def _family_reading(ids: tuple[int, ...], num_layers: int | None, architecture: str | None) -> AuxSpec | None:
    """The states the target family's capture gives for ``ids`` (None where it is not known, or
    not a set of residual-stream states a trace records)."""
    from tracediff.eagle3.conventions import EMBED, specforge_selection, target_for

    if architecture is None or num_layers is None or target_for(architecture) is None:
        return None
    chosen = specforge_selection(architecture, ids, num_layers).selection
    if chosen is None or chosen.error or not chosen.states \
            or any(state.endswith(".branch") for state in chosen.states):
        return None
    layers = tuple(-1 if s == EMBED else int(s.rsplit(".", 1)[1]) for s in chosen.states)
    return AuxSpec(layers, convention=OUTPUT_OF_LAYER)


def note_aux_resolution(module: Any) -> None:
    """Keep the ids SpecForge's own resolver returns (run override, draft config or target default)."""
    original = module.resolve_eagle_capture_layers

    def resolve_eagle_capture_layers(*args: Any, **kwargs: Any) -> Any:
        global resolved_aux
        layers = original(*args, **kwargs)
        resolved_aux = list(layers)
        return layers

    module.resolve_eagle_capture_layers = resolve_eagle_capture_layers


def host(tensor: Any) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def _version(version: Callable[[str], str], name: str) -> str | None:
    try:
        return version(name)
    except Exception:
        return None


__all__ = ["AuxReading", "aux_spec", "contract", "host", "note_aux_resolution"]
