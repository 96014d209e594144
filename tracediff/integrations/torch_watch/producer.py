"""The torch watcher as a producer: claimed by ``--watch``, whatever the command.

Light: the CLI imports it at start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tracediff.integrations.producer import Producer

if TYPE_CHECKING:
    from tracediff.record.plugin import LaunchConfig


def claims(config: LaunchConfig, command: Sequence[str]) -> bool:
    return bool(config.watch)


PRODUCER = Producer(name="torch_watch", plugin="tracediff.integrations.torch_watch.plugin", claims=claims,
                    silent_hint="no module matched the --watch globs, or none ran")
