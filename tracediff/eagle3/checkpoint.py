"""Draft checkpoints in the SpecForge export format: config.json + model.safetensors.

Read with safetensors only (never pickle). Embeddings are optional in the file: absent, they
are shared from the target, which the caller passes in. Loaded under an engine's ``Reading``, the
draft embeds and projects to logits with what that engine takes (tracediff/eagle3/readings.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tracediff.eagle3.config import DraftConfig, read_json_object
from tracediff.eagle3.draft import Eagle3Draft
from tracediff.eagle3.readings import DRAFT, EMBEDDING, TARGET, Reading
from tracediff.errors import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
# Older exporters' names for the fc norms -> SpecForge's export keys.
LEGACY_NAMES = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


def canonical_key(key: str) -> str:
    """A weight's SpecForge export name, also for SGLang-style names (``model.layers.0.``)."""
    key = key.removeprefix("model.")
    if key.startswith("layers.0."):
        key = "midlayer." + key.removeprefix("layers.0.")
    for old, new in LEGACY_NAMES.items():
        key = key.replace(old, new)
    return key


def read_config(path: str | Path) -> DraftConfig:
    """The draft's config.json, typed (its values are judged by ``DraftConfig.problems``)."""
    path = Path(path)
    try:
        return DraftConfig.from_dict(read_json_object(path / CONFIG))
    except FileNotFoundError:
        raise CheckpointError(path, f"no {CONFIG}") from None
    except OSError as exc:
        raise CheckpointError(path / CONFIG, f"cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CheckpointError(path / CONFIG, f"not an EAGLE-3 draft config: {exc}") from None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, keys normalised to the SpecForge export names."""
    path = Path(path)
    try:
        raw = load_file(path / WEIGHTS)
    except FileNotFoundError:
        raise CheckpointError(path, f"no {WEIGHTS}") from None
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(path / WEIGHTS, f"unreadable safetensors file: {exc}") from None
    return {canonical_key(key): value for key, value in raw.items()}


TARGET_KEYS = {"embed": ("model.embed_tokens.weight", "embed_tokens.weight"),
               "lm_head": ("lm_head.weight", "model.lm_head.weight")}


def target_tensor(path: str | Path, part: str) -> torch.Tensor | None:
    """A [vocab, hidden] tensor of an HF target checkpoint directory (any safetensors shard):
    ``part`` "embed" (the input embedding) or "lm_head"; None where no shard holds it."""
    path = Path(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(path, "no *.safetensors files in the target directory")
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                key = next((k for k in TARGET_KEYS[part] if k in f.keys()), None)
                value = None if key is None else f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(shard, f"unreadable safetensors file: {exc}") from None
        if value is not None and value.dim() != 2:
            raise CheckpointError(shard, f"{key} has shape {tuple(value.shape)}, not [vocab, hidden]")
        if value is not None:
            return value
    return None


def target_embedding(path: str | Path) -> torch.Tensor:
    """The input embedding of an HF target checkpoint directory (any safetensors shard)."""
    embed = target_tensor(path, "embed")
    if embed is None:
        raise CheckpointError(path, "no model.embed_tokens.weight in the target's safetensors files")
    return embed


def load_draft(path: str | Path, target_embed: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32, reading: Reading | None = None,
               target_head: torch.Tensor | None = None) -> Eagle3Draft:
    """A draft ready to run; ``target_embed`` stands in for embeddings the checkpoint lacks. Under
    ``reading`` (an engine), embedding and lm_head come from where that engine takes them: SGLang
    embeds with the target's (``target_embed``) and takes the target's lm_head (``target_head``)
    when the config names no draft vocab; without one, as the checkpoint holds them."""
    path = Path(path)
    config = read_config(path)
    if config.problems():  # building the model would divide by zero or fail deep inside torch
        raise CheckpointError(path / CONFIG, "; ".join(config.problems()))
    weights = read_weights(path)
    numerics = None if reading is None else reading.numerics(config)
    if target_embed is not None and ("embed_tokens.weight" not in weights or (
            numerics is not None and numerics.embedding == TARGET)):
        weights["embed_tokens.weight"] = target_embed
    if "embed_tokens.weight" not in weights:
        raise CheckpointError(path, "no embed_tokens.weight in the checkpoint and no target embedding given")
    head = DRAFT if numerics is None else numerics.lm_head
    label = "the engine" if reading is None else reading.label
    if head == TARGET:
        if target_head is None:
            raise CheckpointError(path / CONFIG, f"names no draft_vocab_size: {label} takes the target's "
                                                 "lm_head; pass the target (--target)")
        weights["lm_head.weight"] = target_head
    elif head == EMBEDDING:  # tied: the engine's logits are the first draft-vocab rows of the embedding
        weights["lm_head.weight"] = weights["embed_tokens.weight"][: config.draft_vocab]
    model = Eagle3Draft(config, numerics=numerics)
    expected = model.state_dict()
    notes = []
    if numerics is not None:  # an engine runs the norms it applies with their initial unit weights
        for applied, prefix, flag in ((numerics.fc_norm, "fc_norm.", "fc_norm"),
                                      (numerics.norm_before_fc, "input_norm.", "norm_before_fc")):
            unit = sorted(k for k in expected if k.startswith(prefix) and k not in weights)
            if applied and unit:
                notes.append(f"config.json asks for {flag} and the checkpoint has no {', '.join(unit)}: "
                             f"{label} normalises with unit weights, and so does replay")
            weights.update({k: torch.ones_like(expected[k]) for k in unit})  # unread where not applied
    if head != DRAFT:
        notes.append(f"lm_head: {label} uses "
                     + ("the target's lm_head (the config names no draft_vocab_size)" if head == TARGET
                        else "the embedding's first rows (tie_word_embeddings), not the checkpoint's "
                        "lm_head"))
    missing = sorted(set(expected) - set(weights) - {"d2t", "t2d"})
    if missing:
        raise CheckpointError(path / WEIGHTS, f"missing weights: {', '.join(missing)}")
    for key, value in weights.items():
        if key in expected and tuple(value.shape) != tuple(expected[key].shape):
            raise CheckpointError(path / WEIGHTS, f"{key} has shape {tuple(value.shape)}, config implies "
                                                   f"{tuple(expected[key].shape)}")
    model.load_state_dict({k: v for k, v in weights.items() if k in expected}, strict=False)
    model.notes = tuple(notes)
    return model.to(dtype).eval()


def save_draft(model: Eagle3Draft, path: str | Path, with_embeddings: bool = True) -> None:
    """Write config.json + model.safetensors as SpecForge exports them for SGLang."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if with_embeddings or k != "embed_tokens.weight"}
    save_file(state, path / WEIGHTS)
