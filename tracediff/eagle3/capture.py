"""Target side: which target states feed the draft, and capturing them from an HF causal LM.

"Layer i" means two tensors in the wild: SpecForge/HF read it as the *output* of decoder layer i,
SGLang captures the residual stream *entering* layer i (= output of layer i-1). An ``AuxSpec``
says which reading a producer used, so both can be turned into canonical names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from tracediff.eagle3.names import TARGET_EMBED

OUTPUT_OF_LAYER = "output_of_layer"
INPUT_TO_LAYER = "input_to_layer"


@dataclass(frozen=True)
class AuxSpec:
    """The aux layer set as one engine resolves it."""

    layer_ids: tuple[int, ...]
    convention: str = OUTPUT_OF_LAYER
    embed_slot: bool = False  # an extra first slot holding the embedding output
    ascending: bool = False  # concatenate in ascending layer order (SGLang) instead of list order

    def __post_init__(self) -> None:
        if self.convention not in (OUTPUT_OF_LAYER, INPUT_TO_LAYER):
            raise ValueError(f"unknown aux layer convention {self.convention!r}")

    def sources(self) -> list[str]:
        """Canonical names of the slots in concatenation order (``target.embed``, ``target.layer.i``)."""
        ids = sorted(self.layer_ids) if self.ascending else list(self.layer_ids)
        shift = 0 if self.convention == OUTPUT_OF_LAYER else -1
        names = [TARGET_EMBED if i + shift < 0 else f"target.layer.{i + shift}" for i in ids]
        return [TARGET_EMBED, *names] if self.embed_slot else names

    def to_dict(self) -> dict:
        return {"aux_layer_ids": list(self.layer_ids), "aux_layer_convention": self.convention,
                "aux_embed_slot": self.embed_slot, "aux_ascending": self.ascending,
                "aux_sources": self.sources()}


def parse_aux(text: str, convention: str = OUTPUT_OF_LAYER) -> AuxSpec:
    """``"embed,3,31"`` -> an AuxSpec: layer ids read under ``convention``, ``embed`` only first."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    embed = bool(items) and items[0] == "embed"
    try:
        ids = tuple(int(item) for item in items[1 if embed else 0 :])
    except ValueError:
        raise ValueError(f"--aux takes 'embed' (first) and layer numbers, got {text!r}") from None
    if not ids and not embed:
        raise ValueError("--aux names no layer")
    return AuxSpec(ids, convention=convention, embed_slot=embed)


def default_aux_ids(num_layers: int) -> tuple[int, ...]:
    """SpecForge's fallback: outputs of layers [1, N//2 - 1, N - 4]."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass
class TargetStates:
    """One target forward: ``states[name]`` for target.embed and every target.layer.i, [B, T, H]."""

    states: dict[str, torch.Tensor]
    logits: torch.Tensor  # [B, T, V]

    def aux(self, spec: AuxSpec) -> torch.Tensor:
        """The concatenated aux hidden states [B, T, K*H] that ``spec`` feeds the draft."""
        return torch.cat([self.states[name] for name in spec.sources()], dim=-1)


def run_target(model: torch.nn.Module, input_ids: torch.Tensor) -> TargetStates:
    """Forward an HF Llama-style model and keep the embedding output and each decoder layer's output
    (taken by hooks: HF's ``hidden_states[-1]`` is after the final norm, not the layer's output)."""
    captured: dict[str, torch.Tensor] = {}
    inner = cast(torch.nn.Module, model.model)  # the decoder stack: a submodule mypy sees as Tensor | Module
    embed_tokens = cast(torch.nn.Module, inner.embed_tokens)
    layers = cast(torch.nn.ModuleList, inner.layers)
    handles = [embed_tokens.register_forward_hook(
        lambda m, a, out: captured.__setitem__(TARGET_EMBED, out))]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, out, i=i: captured.__setitem__(f"target.layer.{i}", out[0] if isinstance(out, tuple)
                                                        else out)))
    try:
        with torch.no_grad():
            logits = model(input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return TargetStates(states=captured, logits=logits)
