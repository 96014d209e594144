"""SGLang as a producer: ``tracediff record`` claims its servers and refuses CUDA-graph runs.

A server started by ``python -m sglang.launch_server``, its file, or ``sglang serve`` gets the
plugin; ``tracediff import sglang-dump`` reads SGLang's own dumper files. Light: the CLI imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from tracediff.integrations.producer import Importer, Producer, modules_run

if TYPE_CHECKING:
    from tracediff.record.plugin import LaunchConfig

CUDA_GRAPHS = ("SGLang replays decode steps as CUDA graphs, where hooks never fire: "
               "add --disable-cuda-graph, or record only the eager path (--eager-only)")


def runs_sglang_server(command: Sequence[str]) -> bool:
    """``python -m sglang.launch_server ...``, its file, or the ``sglang serve`` script."""
    if "sglang.launch_server" in modules_run(command):
        return True
    for i, arg in enumerate(command):
        if arg == "sglang.launch_server" or arg.replace(os.sep, "/").endswith("sglang/launch_server.py"):
            return True
        if os.path.basename(arg) == "sglang" and "serve" in command[i + 1:]:
            return True
    return False


def claims(config: LaunchConfig, command: Sequence[str]) -> bool:
    return runs_sglang_server(command)


def refuse(config: LaunchConfig, command: Sequence[str]) -> str | None:
    """A server that would replay its decode steps as CUDA graphs records only its prefills."""
    if runs_sglang_server(command) and not config.eager_only and "--disable-cuda-graph" not in command:
        return CUDA_GRAPHS
    return None


def import_dump(
    source: Path = typer.Argument(..., help="a directory of SGLang dumper files (DUMPER_DIR, or one run's "
                                  "folder in it)"),
    out: Path = typer.Option(..., "--out", "-o", help="the trace to write (.h5 or .arrow): a new file, or "
                             "with --force a regular file to replace"),
    force: bool = typer.Option(False, "--force", help="replace --out if it exists: only a regular file that "
                               "is none of the inputs (never a link, device, FIFO or directory)"),
) -> list[str]:
    """SGLang's own dumper files into a serving trace (loaded with torch.load(weights_only=True))."""
    from tracediff.integrations.sglang.importer import import_sglang_dump
    from tracediff.text import safe

    result = import_sglang_dump(source, out, force=force)
    lines = [f"wrote {', '.join(map(safe, result.paths))}: {result.records} records from {result.files} "
             f"files ({result.steps} steps)"]
    if result.skipped:
        lines.append(f"left out {result.skipped} values that are not tensors tracediff records")
    if result.left_out:
        lines.append(f"left out {result.left_out} non-intrusive dumps: module inputs and modules nested in a "
                     "layer's blocks (docs/INTEGRATIONS.md)")
    if result.steps_without_tokens:
        lines.append(f"note: {result.steps_without_tokens} of {result.steps} steps carry no input_ids: their "
                     "rows align only by step and position (tracediff compare --align step)")
    return lines


def reads_aux(contract: Mapping[str, Any], config: Mapping[str, Any] | None, ids: Sequence[int]) -> Any:
    """A draft's aux ids as SGLang feeds them on the target the contract (or its config) names;
    None when neither says the target's architecture and layer count. ValueError for bad ids."""
    from tracediff.integrations.sglang.aux_reading import sglang_aux
    from tracediff.integrations.target_summary import target_shape

    shape = target_shape(contract, config)
    return None if shape is None else sglang_aux(ids, shape)


PRODUCER = Producer(
    name="sglang", plugin="tracediff.integrations.sglang.plugin", claims=claims, refuse=refuse,
    silent_hint="SGLang's CUDA graphs hide tensors from hooks",
    importers=(Importer("sglang-dump", import_dump),), reads_aux=reads_aux,
)
