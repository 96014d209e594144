"""The one interface every producer of traces offers: what it claims, refuses and attaches.

A producer is one folder under ``tracediff/integrations/`` (its install API, launcher plugin,
importer and contract) and one ``Producer`` line in ``registry.py``; the launcher and the CLI ask
the registry and name no producer themselves. Standard library only: the CLI imports this at start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tracediff.record.plugin import LaunchPlugin


@dataclass(frozen=True)
class Importer:
    """``tracediff import COMMAND``: ``run(**options)`` writes a trace and returns the lines to print;
    bad input is an ``InputError``. Its parameters (typer options) are the command's options."""

    command: str
    run: Callable[..., list[str]]
    needs_torch: bool = True


@dataclass(frozen=True)
class Producer(LaunchPlugin):
    """What ``tracediff record`` (the ``LaunchPlugin`` fields) and ``tracediff import`` need to know of one
    producer."""

    importers: tuple[Importer, ...] = ()
    # replay --aux-convention NAME: (contract, target config or None, a draft's aux ids) -> the AuxSpec
    # this producer feeds for those ids on that target; None when neither names the target's family
    reads_aux: Callable[[Mapping[str, Any], Mapping[str, Any] | None, Sequence[int]], Any] | None = None


def modules_run(command: Sequence[str]) -> list[str]:
    """The modules a command runs with ``-m MODULE`` or ``-mMODULE``."""
    spaced = [arg for flag, arg in zip(command, command[1:]) if flag == "-m"]
    return spaced + [arg[2:] for arg in command if arg.startswith("-m") and len(arg) > 2]


__all__ = ["Importer", "Producer", "modules_run"]
