"""The draft config as every integration states it in a trace's contract: the same keys, read the
same way from an HF config object or a config.json dict, so that a training and a serving trace
differ in ``draft_config`` only where the drafts do (a full ``to_dict()`` on one side and a few
fields on the other would always differ)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracediff.jsonio import stated

KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
        "draft_vocab_size", "target_hidden_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "rope_scaling", "norm_output", "norm_before_fc", "fc_norm")


def draft_config_summary(config: Any) -> dict[str, Any]:
    """``KEYS`` of a draft config (an HF ``PretrainedConfig`` or its dict), JSON-safe; ``rope_theta``
    also where transformers 5 keeps it (``rope_parameters``), ``None`` for a key the config lacks."""
    values = dict(config) if isinstance(config, Mapping) else \
        config.to_dict() if hasattr(config, "to_dict") else vars(config)
    rope = values.get("rope_parameters") or {}
    if values.get("rope_theta") is None and isinstance(rope, Mapping):
        values["rope_theta"] = rope.get("rope_theta")
    if values.get("rope_scaling") is None and isinstance(rope, Mapping) and rope.get("rope_type") not in (
            None, "default"):
        values["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {key: stated(values.get(key)) for key in KEYS}
