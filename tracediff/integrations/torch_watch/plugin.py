"""``tracediff record --watch GLOB -- CMD``: the launcher plugin, which starts the watcher once
torch is imported (nothing happens before; no --watch, nothing at all).

The watcher: ``watcher.py``.
"""

from __future__ import annotations

from tracediff.integrations.torch_watch.watcher import Watcher
from tracediff.record.child import when_imported
from tracediff.record.plugin import LaunchConfig, RecorderFactory


def at_startup(config: LaunchConfig, recorder: RecorderFactory) -> None:
    """Attach once torch is imported; nothing happens before."""
    if config.watch:
        watcher = Watcher(config, recorder)
        when_imported("torch", watcher.install)


__all__ = ["at_startup"]
