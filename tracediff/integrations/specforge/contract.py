"""What a SpecForge training trace states about its run: the contract, and the aux layer ids.

The aux ids are taken as SpecForge resolves them (``aux_spec``): the caller's, else what SpecForge's
own resolver returned in this process (noted by the launcher plugin), else the draft config's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tracediff.eagle3.capture import OUTPUT_OF_LAYER, AuxSpec
from tracediff.integrations.draft_summary import draft_config_summary

resolved_aux: list[int] | None = None  # ids SpecForge's resolver returned in this process


def contract(model: Any, aux: tuple[AuxSpec, str] | None) -> dict[str, Any]:
    """The contract of a recording of ``model`` (an ``OnlineEagle3Model``) with these aux ids."""
    from importlib.metadata import version

    config = model.draft_model.config
    stated: dict[str, Any] = {
        "source": "training", "producer_integration": "specforge",
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
        spec, where = aux
        stated.update(spec.to_dict(), aux_layer_ids_from=where)
    return stated


def aux_spec(config: Any, explicit: Sequence[int] | None,
             num_layers: int | None) -> tuple[AuxSpec, str] | None:
    """SpecForge's aux ids (output of decoder layer i; its SGLang capture packs them ascending),
    and where they came from."""
    eagle = getattr(config, "eagle_config", None) or {}
    found: list[tuple[Any, str]] = [(explicit, "argument"), (resolved_aux, "specforge_resolver"),
                                    (eagle.get("eagle_aux_hidden_state_layer_ids"), "draft_config")]
    if num_layers is not None:
        found.append(([1, num_layers // 2 - 1, num_layers - 4], "target_default"))
    for ids, where in found:
        if ids is not None:
            return AuxSpec(tuple(int(i) for i in ids), convention=OUTPUT_OF_LAYER, ascending=True), where
    return None


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


__all__ = ["aux_spec", "contract", "host", "note_aux_resolution"]
