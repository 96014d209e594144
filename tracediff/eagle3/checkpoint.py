"""Draft checkpoints in the SpecForge export format: config.json + model.safetensors.

Read with safetensors only (never pickle), as untrusted input: each file must be a regular file
(a FIFO would block, a device never end), and every weight's shape, as the file's header states
it, is checked against config.json before anything is allocated. Embeddings are optional in the
file: absent, they are shared from the target, which the caller passes in. Loaded under an engine's
``Reading``, the draft embeds and projects to logits with what that engine takes
(tracediff/eagle3/readings.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tracediff.eagle3.config import DraftConfig, read_json_object
from tracediff.eagle3.draft import Eagle3Draft
from tracediff.eagle3.readings import DRAFT, EMBEDDING, TARGET, Reading
from tracediff.errors import CheckpointError
from tracediff.trace.reader import open_regular

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
# Older exporters' names for the fc norms -> SpecForge's export keys.
LEGACY_NAMES = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}
BLOCK = 1 << 22  # elements of a weight tested for NaN / inf at a time (no full-size mask)


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
        return DraftConfig.from_dict(read_json_object(path / CONFIG), source=str(path / CONFIG))
    except FileNotFoundError:
        raise CheckpointError(path, f"no {CONFIG}") from None
    except OSError as exc:  # a FIFO or device, a link loop, a directory
        raise CheckpointError(path / CONFIG, f"cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CheckpointError(path / CONFIG, f"not an EAGLE-3 draft config: {exc}") from None


@contextmanager
def safetensors_file(file: Path) -> Iterator[Any]:
    """``file`` opened with safetensors (its header parsed, no tensor read), once it is known to be a
    regular file. FileNotFoundError as raised; ``CheckpointError`` for anything else, also for what
    the body reads of it."""
    try:
        os.close(open_regular(file))
    except FileNotFoundError:
        raise
    except OSError as exc:  # a FIFO or device, a link loop, a directory
        raise CheckpointError(file, f"cannot read it: {exc.strerror or exc}") from None
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(file, f"unreadable safetensors file: {exc}") from None


@contextmanager
def _weights(path: Path) -> Iterator[Any]:
    """The checkpoint's model.safetensors, opened (``safetensors_file``)."""
    try:
        with safetensors_file(path / WEIGHTS) as f:
            yield f
    except FileNotFoundError:
        raise CheckpointError(path, f"no {WEIGHTS}") from None


def weight_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in model.safetensors as its header states it (keys normalised to the
    SpecForge export names), read without loading a tensor."""
    with _weights(Path(path)) as f:
        return {canonical_key(key): tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def weight_dtypes(path: str | Path) -> dict[str, str]:
    """Each tensor's dtype in model.safetensors as its header states it ("F32", "I64", "BOOL", ...)."""
    with _weights(Path(path)) as f:
        return {canonical_key(key): str(f.get_slice(key).get_dtype()) for key in f.keys()}


# what each kind of tensor may be stored as: weights in a float type, d2t in an integer type (offsets),
# t2d as booleans (or 0/1 integers, as some exporters write them)
FLOATS = {"F16", "BF16", "F32", "F64"}
INTEGERS = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}
STORED_AS = {"d2t": INTEGERS, "t2d": {"BOOL"} | INTEGERS}


def check_dtypes(path: Path, dtypes: Mapping[str, str], used: Collection[str]) -> None:
    """``CheckpointError`` for the first tensor the draft uses that is stored in a type it cannot be
    (an integer weight is no weight: read as numbers it computes garbage, whatever the engine)."""
    for key in sorted(k for k in dtypes if k in used):
        allowed = STORED_AS.get(key, FLOATS)
        if dtypes[key] not in allowed:
            raise CheckpointError(path / WEIGHTS, f"{key} is stored as {dtypes[key]}: expected "
                                                  f"{' or '.join(sorted(allowed))}")


def check_vocab_map(path: Path, d2t: torch.Tensor, vocab_size: int) -> None:
    """``CheckpointError`` where d2t (offsets) maps a draft id outside the target's vocab: such a
    draft drafts ids no target has (doctor's ``d2t_out_of_range`` says the same)."""
    ids = torch.arange(len(d2t), dtype=torch.int64) + d2t.to(torch.int64)
    outside = torch.nonzero((ids < 0) | (ids >= vocab_size)).reshape(-1)
    if len(outside):
        first = int(outside[0])
        raise CheckpointError(path / WEIGHTS, f"d2t maps {len(outside)} draft ids outside the target's vocab "
                                              f"[0, {vocab_size}): draft id {first} -> {int(ids[first])}")


def read_weights(path: str | Path, keys: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors (only those of ``keys`` when given), keys normalised to the
    SpecForge export names."""
    with _weights(Path(path)) as f:
        return {canonical_key(key): f.get_tensor(key) for key in f.keys()
                if keys is None or canonical_key(key) in keys}


def nonfinite(weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Each floating-point weight holding NaN or inf, as ``lm_head.weight (3 NaN, 1 inf of 49152
    values)``, in ``weights``' order; tested a block at a time (no mask as large as a weight)."""
    out = []
    for key, value in weights.items():
        if not value.is_floating_point() or value.is_meta:
            continue
        flat, nan, inf = value.detach().reshape(-1), 0, 0
        for start in range(0, flat.numel(), BLOCK):
            block = flat[start: start + BLOCK]
            if not bool(torch.isfinite(block).all()):
                nan, inf = nan + int(torch.isnan(block).sum()), inf + int(torch.isinf(block).sum())
        if nan or inf:
            counts = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "inf")) if n)
            out.append(f"{key} ({counts} of {flat.numel()} values)")
    return out


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
            with safetensors_file(shard) as f:
                key = next((k for k in TARGET_KEYS[part] if k in f.keys()), None)
                shape = None if key is None else tuple(f.get_slice(key).get_shape())
                if shape is not None and len(shape) != 2:
                    raise CheckpointError(shard, f"{key} has shape {shape}, not [vocab, hidden]")
                value = None if key is None else f.get_tensor(key)
        except FileNotFoundError:  # a dangling link among the shards
            raise CheckpointError(shard, "cannot read it: no such file") from None
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
    when the config names no draft vocab; without one, as the checkpoint holds them.

    The draft is laid out on the meta device and every weight's shape (the file's, as its header
    states it, or the target's) checked against it before a tensor is read or allocated: a
    config.json that claims sizes its weights do not have is one ``CheckpointError``, never an
    allocation of the sizes it claims."""
    path = Path(path)
    config = read_config(path)
    if config.problems():  # building the model would divide by zero or fail deep inside torch
        raise CheckpointError(path / CONFIG, "; ".join(config.problems()))
    numerics = None if reading is None else reading.numerics(config)
    with torch.device("meta"):
        model = Eagle3Draft(config, numerics=numerics)
    expected = model.state_dict()
    shapes = weight_shapes(path)
    taken: dict[str, torch.Tensor] = {}  # weights from elsewhere than the file, as the engine takes them
    if target_embed is not None and ("embed_tokens.weight" not in shapes or (
            numerics is not None and numerics.embedding == TARGET)):
        taken["embed_tokens.weight"] = target_embed
    if "embed_tokens.weight" not in shapes and not taken:
        raise CheckpointError(path, "no embed_tokens.weight in the checkpoint and no target embedding given")
    head = DRAFT if numerics is None else numerics.lm_head
    label = "the engine" if reading is None else reading.label
    if head == TARGET:
        if target_head is None:
            raise CheckpointError(path / CONFIG, f"names no draft_vocab_size: {label} takes the target's "
                                                 "lm_head; pass the target (--target)")
        taken["lm_head.weight"] = target_head
    shapes.update({key: tuple(value.shape) for key, value in taken.items()})
    if head == EMBEDDING:  # tied: the engine's logits are the first draft-vocab rows of the embedding
        shapes["lm_head.weight"] = tuple(expected["lm_head.weight"].shape)  # as right as the embedding's
    notes, unit = [], []
    if numerics is not None:  # an engine runs the norms it applies with their initial unit weights
        for applied, prefix, flag in ((numerics.fc_norm, "fc_norm.", "fc_norm"),
                                      (numerics.norm_before_fc, "input_norm.", "norm_before_fc")):
            lacking = sorted(k for k in expected if k.startswith(prefix) and k not in shapes)
            if applied and lacking:
                notes.append(f"config.json asks for {flag} and the checkpoint has no {', '.join(lacking)}: "
                             f"{label} normalises with unit weights, and so does replay")
            unit += lacking  # unread where not applied
    if head != DRAFT:
        notes.append(f"lm_head: {label} uses "
                     + ("the target's lm_head (the config names no draft_vocab_size)" if head == TARGET
                        else "the embedding's first rows (tie_word_embeddings), not the checkpoint's "
                        "lm_head"))
    missing = sorted(set(expected) - set(shapes) - set(unit) - {"d2t", "t2d"})
    if missing:
        raise CheckpointError(path / WEIGHTS, f"missing weights: {', '.join(missing)}")
    _check_shapes(path, {key: tuple(want.shape) for key, want in expected.items()}, shapes, set(taken))
    check_dtypes(path, weight_dtypes(path), set(expected) - set(taken) - set(unit))
    model.load_state_dict(_state(path, expected, taken, unit, head, config), assign=True)
    check_vocab_map(path, model.d2t, config.vocab_size)
    model.notes = tuple(notes + config.uncomputed())
    return model.to(dtype).eval()


def _check_shapes(path: Path, expected: Mapping[str, tuple[int, ...]], shapes: Mapping[str, tuple[int, ...]],
                  taken: set[str]) -> None:
    """``CheckpointError`` for the first weight whose shape is not the one config.json implies: the
    file's first (naming model.safetensors), then those taken from the target (naming config.json:
    the target's are the target's)."""
    for key in sorted(expected, key=lambda k: k in taken):
        have, want = shapes.get(key), expected[key]
        if have is None or have == want:
            continue
        if key in taken:
            raise CheckpointError(path / CONFIG, f"implies {key} of shape {want}; the target's has shape "
                                                 f"{have}")
        raise CheckpointError(path / WEIGHTS, f"{key} has shape {have}, config implies {want}")


def _state(path: Path, expected: Mapping[str, torch.Tensor], taken: Mapping[str, torch.Tensor],
           unit: list[str], head: str, config: DraftConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the draft (shapes checked by ``load_draft``), in the model's dtypes: the
    file's (only those the draft takes from it), copies of ``taken``'s, unit norm weights, the tied
    lm_head (a copy of the embedding's first rows), and a vocab map of none (d2t zeros, t2d all
    true) where the file has none."""
    tied = {"lm_head.weight"} if head == EMBEDDING else set()
    weights: dict[str, torch.Tensor] = read_weights(path, set(expected) - set(taken) - set(unit) - tied)
    weights.update(taken)
    weights.update({key: torch.ones(expected[key].shape) for key in unit})
    if head == EMBEDDING:
        weights["lm_head.weight"] = weights["embed_tokens.weight"][: config.draft_vocab]
    defaults = {"d2t": lambda: torch.zeros(config.draft_vocab, dtype=torch.int64),
                "t2d": lambda: torch.ones(config.vocab_size, dtype=torch.bool)}
    weights.update({key: make() for key, make in defaults.items() if key not in weights})
    shared = set(taken) | tied  # the caller's tensors, a view of another weight: never the draft's own
    return {key: weights[key].to(want.dtype, copy=key in shared) for key, want in expected.items()}


def save_draft(model: Eagle3Draft, path: str | Path, with_embeddings: bool = True) -> None:
    """Write config.json + model.safetensors as SpecForge exports them for SGLang."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if with_embeddings or k != "embed_tokens.weight"}
    save_file(state, path / WEIGHTS)
