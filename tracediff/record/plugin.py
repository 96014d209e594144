"""What the launcher asks of a producer: the one home of those fields (integrations/producer.py's
``Producer`` adds what the rest of tracediff asks of it).

Standard library only: the CLI imports this at start, through the registry of producers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracediff.record.launch import LaunchConfig


def never(config: LaunchConfig, command: Sequence[str]) -> str | None:
    """A producer that refuses (or advises) nothing before start."""
    return None


@dataclass(frozen=True)
class LaunchPlugin:
    """A producer as ``tracediff record -- CMD`` sees it."""

    name: str
    plugin: str  # the module whose ``at_startup(config, recorder)`` runs in every process of the child
    claims: Callable[[LaunchConfig, Sequence[str]], bool]  # whether its plugin is needed for this run
    refuse: Callable[[LaunchConfig, Sequence[str]], str | None] = never  # why the run would be pointless
    silent_hint: str | None = None  # a likely cause when a run with its plugin wrote no file
    advise: Callable[[LaunchConfig, Sequence[str]], str | None] = never  # a note printed at start
