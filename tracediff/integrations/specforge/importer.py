"""SpecForge's offline hidden-state files into a trace: one ``torch.save`` dict per sample
(``data_*.ckpt``, or ``.ckpt.gz``) holding ``input_ids`` [L], ``loss_mask`` [L],
``aux_hidden_state`` [1, L, K*H] (the fc input the draft trains on) and ``hidden_state`` [1, L, H]
(the target's last state, after its final norm).

Files are loaded with ``torch.load(..., weights_only=True)``: a feature file is tensors in a dict,
and anything that needs real unpickling is refused, never run. Each sample becomes one request
(named after its file) whose tokens are declared, so it aligns with a serving trace by content.
"""

from __future__ import annotations

import gzip
import io
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracediff.eagle3.names import TARGET_AUX, TARGET_FINAL_HIDDEN, TRAIN_LOSS_MASK
from tracediff.errors import InputError
from tracediff.integrations.importing import RECORDER_OPTIONS, check_written
from tracediff.integrations.torch_files import load_tensors, names_as_data, refusal
from tracediff.record.recorder import Recorder
from tracediff.text import safe
from tracediff.trace.output import check_output, staged_output
from tracediff.trace.storage import unwritable_suffix

SUFFIXES = (".ckpt", ".ckpt.gz")
KEYS = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")
VECTORS = ("aux_hidden_state", "hidden_state")  # [1, L, width]; the others are [L] or [1, L]
# What each key becomes in the trace (docs/FORMAT.md's canonical names where one exists).
NAMES = {"aux_hidden_state": TARGET_AUX, "hidden_state": TARGET_FINAL_HIDDEN,
         "loss_mask": TRAIN_LOSS_MASK}
QUEUE_BYTES = 256 << 20  # the recorder's default bound


@dataclass
class FeaturesImported:
    files: int
    rows: int
    path: Path


def feature_files(source: Path) -> list[Path]:
    """The feature files under ``source`` (or ``source`` itself), sorted as SpecForge reads them."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise InputError(source, "no such file or directory")
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise InputError(source, f"holds no SpecForge feature files ({', '.join(SUFFIXES)})")
    return files


def load_sample(path: Path) -> dict[str, Any]:
    """One feature file's tensors, checked: one ``error:`` line for anything else."""
    import torch

    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a damaged .gz
        raise InputError(path, f"cannot be read: {refusal(exc)}") from None
    data = load_tensors(path, "a feature file", io.BytesIO(raw))
    if not isinstance(data, dict) or any(key not in data for key in KEYS):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise InputError(path, f"expected a dict with {', '.join(KEYS)}; found {found}")
    tokens = data["input_ids"]
    if (not isinstance(tokens, torch.Tensor) or tokens.dtype == torch.bool or tokens.dtype.is_floating_point
            or tokens.dtype.is_complex):
        raise InputError(path, "input_ids is not an integer tensor")
    length = tokens.reshape(-1).shape[0]
    for key in KEYS[1:]:
        if not isinstance(data[key], torch.Tensor):
            raise InputError(path, f"{key} is not a tensor")
        if key in VECTORS and (data[key].dim() < 2 or data[key].shape[-1] == 0):
            raise InputError(path, f"{key} has shape {list(data[key].shape)}, not [1, L, width]")
        if (positions := per_token(key, data[key]).shape[0]) != length:
            raise InputError(path, f"{key} has {positions} positions, input_ids {length}")
    data["loss_mask"] = whole_mask(path, data["loss_mask"])
    return data


def whole_mask(path: Path, mask: Any) -> Any:
    """``loss_mask`` as int64, whatever dtype a file stores it in (SpecForge's is long; a bool or a
    float 0/1 mask is the same mask): one name keeps one dtype across the trace. A mask whose values
    are not whole numbers is no loss mask: one ``error:`` line."""
    import torch

    if mask.dtype.is_complex or mask.dtype.is_floating_point and not bool(
            torch.isfinite(mask).all() and (mask == mask.round()).all()):
        raise InputError(path, f"loss_mask holds values that are not whole numbers ({mask.dtype})")
    return mask.to(torch.int64)


def per_token(key: str, value: Any) -> Any:
    """A feature as one row per token: hidden states keep their last axis, the rest is flattened."""
    return value.reshape(-1, value.shape[-1]) if key in VECTORS else value.reshape(-1)


@names_as_data
def import_specforge_ckpt(source: Path, out: Path, *, aux_layer_ids: list[int] | None = None,
                          target_model: str | None = None,
                          queue_bytes: int = QUEUE_BYTES, force: bool = False) -> FeaturesImported:
    """Write the samples under ``source`` as a training trace at ``out``. ``aux_layer_ids`` (the
    training config's, SpecForge's output-of-layer convention) and ``target_model`` go into the
    contract: the files do not say which layers they hold. ``queue_bytes``: the recorder's bound; a
    sample's feature larger than it is still written, alone (memory: the larger of the two)."""
    files = feature_files(source)
    if problem := unwritable_suffix(out):
        raise InputError(out, problem)
    if not out.parent.is_dir():
        raise InputError(out, f"output directory {out.parent} does not exist")
    check_output(out, files, force)  # an existing output only with force; never a link or an input
    contract: dict[str, Any] = {"imported_from": "specforge-ckpt", "aux_layer_convention": "output_of_layer"}
    if aux_layer_ids is not None:
        contract["aux_layer_ids"] = list(aux_layer_ids)
    if target_model is not None:
        contract["target_model"] = target_model
    with staged_output(out, files, force) as staged:  # a bad file half way: no half trace left behind
        rows = _write(files, staged, out, contract, queue_bytes)
    return FeaturesImported(files=len(files), rows=rows, path=out)


def _write(files: list[Path], out: Path, target: Path, contract: dict[str, Any], queue_bytes: int) -> int:
    """Record the samples into ``out`` (the staged file of ``target``, the user's output)."""
    rows = 0
    with Recorder(out, source="training", meta=contract, strict=True, queue_bytes=queue_bytes,
                  **RECORDER_OPTIONS) as rec:
        rec.oversized_alone = True  # a record over queue_bytes waits for an empty queue, never refused
        for step, path in enumerate(files):
            sample = load_sample(path)
            request = safe(path.name.split(".", 1)[0])  # a lone surrogate in a file name is no request id
            tokens = sample["input_ids"].reshape(-1).to("cpu")
            try:  # strict: a file whose features differ in dtype or width from the earlier files
                rec.request_tokens(request, tokens)
                for key, name in NAMES.items():
                    rec.log(name, per_token(key, sample[key]), step=step, request=request, token_ids=tokens)
            except ValueError as exc:
                raise InputError(path, str(exc)) from None
            rows += int(tokens.shape[0])
    check_written(rec, target)
    return rows


def ids(text: str) -> list[int]:
    """'1,15,28' -> [1, 15, 28]; ValueError otherwise."""
    return [int(part) for part in text.split(",") if part.strip()] if text.strip() else []


__all__ = ["FeaturesImported", "feature_files", "ids", "import_specforge_ckpt", "load_sample"]
