"""What defines a target model, as every producer states it in a trace's contract: the config's
architecture and sizes (``target_config``) and a fingerprint of the input embedding
(``target_embedding_sha256``). Compare tells targets apart by these, not by a name or a path
(tracediff/diff/contract_diff.py).

The fingerprint is the SHA-256 of the embedding's first ``EMBED_ROWS`` rows rounded to bfloat16:
the same for one checkpoint loaded in float32 or bfloat16 (both round the same way), or in float16
from a 16-bit checkpoint (which rounds back exactly); a few hundred KB to hash whatever the
vocabulary. ``target_shape``: the class and layer count an engine's reading of aux ids depends on."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size")
EMBED_ROWS = 256


def target_config_summary(config: Any, model: Any = None) -> dict[str, Any]:
    """``KEYS`` of a target's config (an HF ``PretrainedConfig`` or its dict; the text config of a
    multimodal one) and its ``architecture``: the config's first, else ``model``'s class name."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    values = dict(config) if isinstance(config, Mapping) else \
        config.to_dict() if hasattr(config, "to_dict") else vars(config)
    architectures = values.get("architectures") or []
    architecture = architectures[0] if architectures else type(model).__name__ if model is not None else None
    summary = {key: values.get(key) for key in KEYS}
    summary["architecture"] = None if architecture is None else str(architecture)
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
            for k, v in summary.items()}


def embedding_sha256(weight: Any) -> str:
    """The fingerprint of an input embedding's weight [V, H] (module docstring)."""
    import torch

    rows = weight.detach()[:EMBED_ROWS].to("cpu", torch.bfloat16).contiguous()
    return hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()


def target_identity(model: Any) -> dict[str, Any]:
    """The contract keys that identify ``model`` (an HF causal LM, or an engine's model with the same
    ``config`` and ``get_input_embeddings`` / ``model.embed_tokens``); {} for what it cannot tell."""
    out: dict[str, Any] = {}
    config = getattr(model, "config", None)
    if config is not None:
        out["target_config"] = target_config_summary(config, model)
    embed = _input_embedding(model)
    weight = getattr(embed, "weight", None)
    if weight is not None and getattr(weight, "ndim", 0) == 2 and weight.numel() and not weight.is_meta \
            and _starts_at_row_0(embed):
        try:
            out["target_embedding_sha256"] = embedding_sha256(weight)
        except Exception:  # a weight this process cannot read whole (a sharded parameter): no fingerprint
            pass
    return out


def _input_embedding(model: Any) -> Any:
    """The input embedding module: ``get_input_embeddings()`` where it returns one (SGLang's
    MiniMax-M2 names a method so that embeds ids instead), else the text model's ``embed_tokens``."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            found = get()
        except (NotImplementedError, TypeError):
            found = None
        if getattr(found, "weight", None) is not None:
            return found
    return getattr(getattr(model, "model", None), "embed_tokens", None)


def _starts_at_row_0(embed: Any) -> bool:
    """Whether the module holds the vocabulary from token 0 (a tensor-parallel shard of another
    rank holds other rows: its hash is not the model's)."""
    shard = getattr(embed, "shard_indices", None)
    start = getattr(shard, "org_vocab_start_index", getattr(embed, "vocab_start_index", 0))
    return start == 0


@dataclass(frozen=True)
class TargetShape:
    """What an engine's reading of aux ids depends on: the served class and its layer count."""

    architecture: str
    num_layers: int


def target_shape(contract: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> TargetShape | None:
    """The target's architecture and layer count: from a trace's contract (the class an engine served,
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
