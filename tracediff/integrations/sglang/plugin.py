"""``tracediff record -- python -m sglang.launch_server ...``: in every server process, record each
model as SGLang finishes loading it, keyed from the batches its scheduler runs."""

from __future__ import annotations

import logging
from typing import Any

from tracediff.integrations.sglang.contract import tp_ranks
from tracediff.integrations.sglang.install import batch_context, install
from tracediff.record.launch import LaunchConfig, RecorderFactory, when_imported

logger = logging.getLogger("tracediff")


class _Plugin:
    """Attaches ``install`` in a server process as SGLang loads its models (``tracediff record``)."""

    def __init__(self, config: LaunchConfig, factory: RecorderFactory) -> None:
        self.config, self.factory = config, factory
        self.failed = False
        self.models: set[int] = set()

    def attach(self, **models: Any) -> None:
        """install(...) on a model SGLang just loaded; failures are one warning, never raised."""
        model = next(iter(models.values()))
        if self.failed or id(model) in self.models:
            return
        self.models.add(id(model))
        try:
            rank = tp_ranks()
            rec = self.factory(rank.get("tp_rank"), rank.get("tp_size"), source="serving")
            if rec.active:
                install(rec, requests=self.config.requests, match_prefix=self.config.match_prefix, **models)
        except Exception as exc:
            self.failed = True
            logger.warning("tracediff: not recording SGLang (%s: %s); the server runs as usual",
                           type(exc).__name__, exc)

    def patch_loader(self, cls: Any, role: str) -> None:
        original = cls.load_weights

        def load_weights(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(model, *args, **kwargs)
            self.attach(**{role: model})
            return result

        cls.load_weights = load_weights

    def patch_scheduler(self, module: Any) -> None:
        """Each batch the scheduler runs starts with ``batch_context(batch.reqs)``."""
        original = module.Scheduler.run_batch

        def run_batch(scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            batch_context(getattr(batch, "reqs", None) or ())
            return original(scheduler, batch, *args, **kwargs)

        module.Scheduler.run_batch = run_batch


def at_startup(config: LaunchConfig, recorder: RecorderFactory) -> None:
    """In every process: once SGLang's Llama / EAGLE-3 model modules are imported, record each model
    as it finishes loading its weights; rows are keyed from the batches ``Scheduler.run_batch`` runs."""
    try:
        plugin = _Plugin(config, recorder)
        when_imported("sglang.srt.models.llama",
                      lambda m: plugin.patch_loader(m.LlamaForCausalLM, "target"))
        when_imported("sglang.srt.models.llama_eagle3",
                      lambda m: plugin.patch_loader(m.LlamaForCausalLMEagle3, "draft"))
        when_imported("sglang.srt.managers.scheduler", plugin.patch_scheduler)
    except Exception as exc:
        logger.warning("tracediff: the SGLang plugin did not start (%s: %s); nothing is recorded",
                       type(exc).__name__, exc)
