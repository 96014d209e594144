"""What a SpecForge training trace states about its run: the contract, and the aux layer ids.

The aux ids are taken as SpecForge resolves them (``aux_spec``): the caller's, else what SpecForge's
own resolver returned in this process (noted by the launcher plugin), else the draft config's. They
are read as the target the features come from reads them (``read_ids``): SGLang's class as its
family captures, an HF model's ``hidden_states[i+1]`` as the output of layer i; a reading that
cannot apply says so in ``aux_layer_reading`` and states no aux states.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tracediff.eagle3.conventions import (
    aux_state_keys,
    capture_refusal,
    hf_states,
    specforge_selection,
    target_for,
)
from tracediff.eagle3.draft_summary import draft_config_summary
from tracediff.eagle3.versions import SGLANG_VERSION, SPECFORGE_VERSION

resolved_aux: list[int] | None = None  # ids SpecForge's resolver returned in this process
SGLANG, HF = "sglang", "hf"  # the engines a target model comes from (``engine_of``)


class AuxReading(NamedTuple):
    """The aux ids SpecForge trains with, where they came from, how they were read, and the states
    they select in slot order (None: the reading cannot apply, and ``reading`` says why)."""

    ids: tuple[int, ...]
    where: str  # argument / specforge_resolver / draft_config / target_default
    reading: str
    states: tuple[str, ...] | None

    def contract(self) -> dict[str, Any]:
        stated = {"aux_layer_ids": list(self.ids), "aux_layer_ids_from": self.where,
                  "aux_layer_reading": self.reading}
        return stated if self.states is None else {**stated, **aux_state_keys(self.states)}


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
             target: Any = None) -> AuxReading | None:
    """SpecForge's aux ids and where they came from (the first given of: ``explicit``, what its
    resolver returned, the draft config's, its default for ``num_layers``), read as ``target`` (the
    model the features come from, if given) reads them."""
    eagle = getattr(config, "eagle_config", None) or {}
    found: list[tuple[Any, str]] = [(explicit, "argument"), (resolved_aux, "specforge_resolver"),
                                    (eagle.get("eagle_aux_hidden_state_layer_ids"), "draft_config")]
    if num_layers is not None:
        found.append(([1, num_layers // 2 - 1, num_layers - 4], "target_default"))
    for ids, where in found:
        if ids is not None:
            ids = tuple(int(i) for i in ids)
            return AuxReading(ids, where, *read_ids(ids, num_layers, target))
    return None


def engine_of(target: Any) -> str | None:
    """``SGLANG`` for a model class of SGLang's, ``HF`` for one of transformers' (remote code
    included), None for anything else or nothing."""
    package = type(target).__module__.split(".")[0] if target is not None else ""
    return SGLANG if package == "sglang" else HF if package in ("transformers", "transformers_modules") \
        else None


Reading = tuple[str, tuple[str, ...] | None]  # how the ids were read, the states they select (or None)


def read_ids(ids: tuple[int, ...], num_layers: int | None, target: Any) -> Reading:
    """(how the ids were read, the states they select in slot order or None where that reading
    cannot apply). SpecForge 0.2.0 captures through the target family's own SGLang setter: an SGLang
    ``target`` reads them as its class does (DeepSeek keeps ids not starting at 1: [2, 3, 4] trains on
    layers 1, 2, 3; gpt-oss keeps ids ending at the layer count: the last is the stream before the
    final norm). Features from an HF ``target`` are its ``hidden_states[i+1]``: the output of layer i
    (-1: the embeddings), packed ascending; without a target they are read so too, as most families
    read them, saying the family was not given."""
    engine, name = engine_of(target), type(target).__name__
    if engine == SGLANG:
        return _through_sglang(ids, num_layers, name)
    how = "output of layer i " + (f"(HF hidden_states[i+1] of {name})" if engine == HF
                                  else "(the target's family not given)" if target is None
                                  else f"(the target, a {name}, is neither an SGLang nor an HF model)")
    beyond = [i for i in ids if i < -1 or (num_layers is not None and i >= num_layers)]
    if beyond:
        named = f"id {beyond[0]} names" if len(beyond) == 1 else f"ids {beyond} name"
        layers = "" if num_layers is None else f" of the target's {num_layers} layers"
        return f"{how}: {named} no layer's output{layers}: not read", None
    return how, tuple(hf_states(sorted(ids)))


def _through_sglang(ids: tuple[int, ...], num_layers: int | None, cls: str) -> Reading:
    how = f"specforge {SPECFORGE_VERSION} through sglang's {cls}"
    if target_for(cls) is None:
        return f"{how}: not an EAGLE-3 target class of sglang {SGLANG_VERSION}: not read", None
    if num_layers is None:
        return f"{how}: the target's layer count is not known: not read", None
    chosen = specforge_selection(cls, ids, num_layers, offline=False)
    if chosen.selection is None:
        return f"{how}: SpecForge {SPECFORGE_VERSION} refuses the ids ({chosen.ids.refusal}): not read", None
    refusal = capture_refusal(chosen.selection)
    if refusal is not None:
        return f"{how}: {refusal}: not read", None
    return how, chosen.selection.states


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


__all__ = ["AuxReading", "aux_spec", "contract", "engine_of", "host", "note_aux_resolution", "read_ids"]
