"""SpecForge as a producer: ``tracediff record`` claims its trainers, ``tracediff import
specforge-ckpt`` reads its offline hidden-state files.

Light (no torch, no SpecForge): the CLI imports it at start.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tracediff.errors import InputError
from tracediff.integrations.producer import Importer, Producer, modules_run

if TYPE_CHECKING:
    from tracediff.record.plugin import LaunchConfig


def runs_specforge(command: Sequence[str]) -> bool:
    """The ``specforge`` console script (``specforge train ...``) or ``python -m specforge.cli``."""
    return (any(os.path.basename(arg) == "specforge" for arg in command)
            or any(m == "specforge" or m.startswith("specforge.") for m in modules_run(command)))


def claims(config: LaunchConfig, command: Sequence[str]) -> bool:
    return runs_specforge(command)


def import_features(
    source: Path = typer.Argument(..., help="a directory of SpecForge offline feature files "
                                  "(data_*.ckpt), or one file"),
    out: Path = typer.Option(..., "--out", "-o", help="the trace to write (.h5 or .arrow): a new file, or "
                             "with --force a regular file to replace"),
    force: bool = typer.Option(False, "--force", help="replace --out if it exists: only a regular file that "
                               "is none of the inputs (never a link, device, FIFO or directory)"),
    aux_layer_ids: str | None = typer.Option(None, "--aux-layer-ids", help="the training config's aux "
                                             "layer ids (e.g. '1,15,28'), for the trace's contract"),
    target_model: str | None = typer.Option(None, "--target-model", help="the target model, for the "
                                            "contract"),
) -> list[str]:
    """SpecForge's offline hidden states into a training trace (loaded with torch.load(weights_only=True))."""
    from tracediff.integrations.specforge.importer import ids, import_specforge_ckpt
    from tracediff.text import safe

    try:
        layers = ids(aux_layer_ids) if aux_layer_ids is not None else None
    except ValueError:
        raise InputError("--aux-layer-ids",
                         f"expected comma-separated integers, got {aux_layer_ids!r}") from None
    done = import_specforge_ckpt(source, out, aux_layer_ids=layers, target_model=target_model,
                                 force=force)
    return [f"wrote {safe(done.path)}: {done.rows} rows from {done.files} files"]


PRODUCER = Producer(name="specforge", plugin="tracediff.integrations.specforge.plugin", claims=claims,
                    importers=(Importer("specforge-ckpt", import_features),))
