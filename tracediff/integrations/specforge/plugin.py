"""``tracediff record -- specforge train ...`` (or ``--plugin tracediff.integrations.specforge``):
install on every ``OnlineEagle3Model`` built, once SpecForge's model module is imported.

Nothing is imported at start-up; SpecForge's aux-id resolver is wrapped to note what it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from tracediff.integrations.specforge.facts import note_aux_resolution
from tracediff.integrations.specforge.guard import MODEL_MODULE
from tracediff.integrations.specforge.recording import install
from tracediff.record.child import when_imported
from tracediff.record.plugin import RequestGate
from tracediff.record.recorder import Recorder

logger = logging.getLogger("tracediff")
PROVIDERS_MODULE = "specforge.algorithms.model_providers"


def at_startup(config: Any, recorder: Callable[..., Recorder]) -> None:
    """Launcher plugin: install on every ``OnlineEagle3Model`` once SpecForge's model module is
    imported (nothing is imported here). Never raises: a problem is one warning."""
    try:
        gate = RequestGate.of(config)
        admit = gate.admit if gate.active else None
        when_imported(MODEL_MODULE, lambda module: _attach_on_construction(module, recorder, admit))
        when_imported(PROVIDERS_MODULE, note_aux_resolution)
    except Exception as exc:
        logger.warning("tracediff: the SpecForge plugin did not attach: %s: %s", type(exc).__name__, exc)


def _attach_on_construction(module: ModuleType, recorder: Callable[..., Recorder],
                            admit: Callable[[str, Sequence[int]], bool] | None) -> None:
    cls = module.OnlineEagle3Model
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            install(recorder(source="training"), self, admit=admit)
        except Exception as exc:
            logger.warning("tracediff: not recording this SpecForge model: %s", exc)

    cls.__init__ = __init__


__all__ = ["at_startup"]
