"""What ``--watch`` calls the modules it records, and which tensors it can record.

Names: in an HF causal LM (``LlamaForCausalLM`` etc., also inside a wrapper) the embedding is
``target.embed`` and decoder layer i ``target.layer.{i}`` (its output, docs/FORMAT.md); other
modules keep their dotted name. The contract's ``target_model`` names the HF model (its config's
``name_or_path``, else its architecture and a hash of its config); ``target_config`` and
``target_embedding_sha256`` identify it (tracediff/integrations/target_summary.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from tracediff.eagle3.names import TARGET_EMBED
from tracediff.record.copies import tag_of_tensor

# config keys that say how a model runs, not which model it is
NOT_IDENTITY = {"transformers_version", "dtype", "torch_dtype", "architectures", "use_cache", "return_dict",
                "output_hidden_states", "output_attentions", "attn_implementation"}


def glob_regex(glob: str) -> re.Pattern[str]:
    """A dotted-name glob: ``*`` one part, ``**`` any number of parts, ``?`` one character."""
    parts = re.split(r"(\*\*|\*|\?)", glob)
    table = {"**": ".*", "*": "[^.]+", "?": "[^.]"}
    return re.compile("".join(table.get(p, re.escape(p)) for p in parts) + r"\Z")


def causal_lm(root: Any) -> tuple[Any, dict[str, str]] | None:
    """The HF causal LM in ``root`` and the canonical names of its embedding and decoder layers,
    by dotted module name; None when there is none."""
    modules = dict(root.named_modules())
    for prefix, module in modules.items():
        if not type(module).__name__.endswith("ForCausalLM"):
            continue
        base = ".".join(p for p in (prefix, getattr(module, "base_model_prefix", "model")) if p)
        layers = modules.get(f"{base}.layers")
        if layers is None or f"{base}.embed_tokens" not in modules:
            continue
        names = {f"{base}.embed_tokens": TARGET_EMBED}
        names.update({f"{base}.layers.{i}": f"target.layer.{i}" for i in range(len(layers))})
        return module, names
    return None


def causal_lm_names(root: Any) -> dict[str, str]:
    """Canonical names of an HF causal LM's embedding and decoder layers, by dotted module name."""
    found = causal_lm(root)
    return found[1] if found else {}


def model_identity(model: Any) -> str | None:
    """The contract's ``target_model``: the config's ``name_or_path`` when set, else the architecture
    and a short hash of the config (equal for other weights of one model, not for another model)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    name = getattr(config, "name_or_path", "") or ""
    if name:
        return str(name)
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in NOT_IDENTITY}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()
    return f"{type(model).__name__}-{digest[:12]}"


def recordable(x: Any) -> bool:
    """A tensor of a dtype a trace holds, not a subclass (a meta tensor is the recorder's to count)."""
    import torch

    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        tag_of_tensor(x)
    except ValueError:
        return False
    return True


def watchable(name: str) -> bool:
    """A name a tensor can be recorded under: not the root's empty name, not the format's ``__``."""
    return bool(name) and not name.startswith("__")


__all__ = ["causal_lm", "causal_lm_names", "glob_regex", "model_identity", "recordable", "watchable"]
