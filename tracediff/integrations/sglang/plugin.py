"""``tracediff record -- python -m sglang.launch_server ...``: in every server process, record each
model as SGLang finishes loading it, keyed from the batches its scheduler runs.

Which models: every class a model file of ``sglang.srt.models`` registers (its ``EntryClass``, what
SGLang's ModelRegistry serves) that ``models.model_role`` calls a target (it defines
``set_eagle3_layers_to_capture``: 29 files in 0.5.23, VL wrappers included) or an EAGLE-3 draft;
patched as each model file is imported, so no list of families is kept here."""

from __future__ import annotations

import importlib.util
import logging
import os
import pkgutil
from typing import Any

from tracediff.integrations.sglang.facts import tp_ranks
from tracediff.integrations.sglang.hooks import batch_context, install
from tracediff.integrations.sglang.models import MODELS, model_role
from tracediff.record.child import when_imported
from tracediff.record.plugin import LaunchConfig, RecorderFactory

logger = logging.getLogger("tracediff")


class _Plugin:
    """Attaches ``install`` in a server process as SGLang loads its models (``tracediff record``)."""

    def __init__(self, config: LaunchConfig, factory: RecorderFactory) -> None:
        self.config, self.factory = config, factory
        self.failed = False
        self.models: set[int] = set()

    def attach(self, model: Any) -> None:
        """install(...) on a model SGLang just loaded, as the role its class has; failures are one
        warning naming the class, never raised."""
        role = model_role(type(model))
        if self.failed or role is None or id(model) in self.models:
            return
        self.models.add(id(model))
        try:
            rank = tp_ranks()
            rec = self.factory(rank.get("tp_rank"), rank.get("tp_size"), source="serving")
            if rec.active:
                install(rec, requests=self.config.requests, match_prefix=self.config.match_prefix,
                        **{role: model})
        except Exception as exc:
            self.failed = True
            logger.warning("tracediff: not recording SGLang's %s %s (%s: %s); the server runs as usual", role,
                           type(model).__qualname__, type(exc).__name__, exc)

    def patch_loader(self, cls: Any) -> None:
        """Attach once ``cls.load_weights`` returns (a subclass and its base patched both attach once)."""
        if "load_weights" in cls.__dict__ and getattr(cls.__dict__["load_weights"], "_tracediff", False):
            return
        original = cls.load_weights

        def load_weights(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(model, *args, **kwargs)
            self.attach(model)
            return result

        load_weights._tracediff = True  # type: ignore[attr-defined]
        cls.load_weights = load_weights

    def patch_models(self, module: Any) -> None:
        """The classes one model file registers (``EntryClass``) that record as a target or draft."""
        entries = getattr(module, "EntryClass", None)
        for cls in entries if isinstance(entries, (list, tuple)) else [entries]:
            if isinstance(cls, type) and model_role(cls) and callable(getattr(cls, "load_weights", None)):
                self.patch_loader(cls)

    def watch_models(self) -> None:
        """Every model file of ``sglang.srt.models`` (a namespace package: listed from its folders
        without importing SGLang), patched as it is imported (SGLang imports the ones it serves)."""
        spec = importlib.util.find_spec("sglang")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for info in pkgutil.iter_modules([os.path.join(folder, "srt", "models")]):
                when_imported(f"{MODELS}{info.name}", self.patch_models)

    def patch_scheduler(self, module: Any) -> None:
        """Each batch the scheduler runs starts with ``batch_context(batch.reqs)``."""
        original = module.Scheduler.run_batch

        def run_batch(scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            batch_context(getattr(batch, "reqs", None) or ())
            return original(scheduler, batch, *args, **kwargs)

        module.Scheduler.run_batch = run_batch


def at_startup(config: LaunchConfig, recorder: RecorderFactory) -> None:
    """In every process: once SGLang's model files are imported, record each target or EAGLE-3
    draft as it finishes loading its weights; rows are keyed from the batches ``Scheduler.run_batch``
    runs."""
    try:
        plugin = _Plugin(config, recorder)
        plugin.watch_models()
        when_imported("sglang.srt.managers.scheduler", plugin.patch_scheduler)
    except Exception as exc:
        logger.warning("tracediff: the SGLang plugin did not start (%s: %s); nothing is recorded",
                       type(exc).__name__, exc)
