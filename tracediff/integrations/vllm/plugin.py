"""Recording a vLLM server's workers: ``tracediff record -- vllm serve ...`` (or ``python -m vllm...``).

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (API server, engine core,
workers); tracediff's is ``register``. Outside ``tracediff record`` (no ``TRACEDIFF_LAUNCH`` in the
environment) it returns at once: installed but not recording, it attaches nothing. Under the launcher
it wraps the model runners' ``load_model``: once a worker has loaded its target, drafter and aux
selection, ``install`` attaches to that runner. The launcher's own start-up (``at_startup``) does the
same when the runner module is imported, so a vLLM that never calls its plugins is recorded too.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from tracediff.record.child import when_imported
from tracediff.record.plugin import ENV, LaunchConfig, RecorderFactory

logger = logging.getLogger("tracediff")

RUNNERS = (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
           ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"))


class _Plugin:
    """Attaches ``install`` to each runner of this process as it finishes ``load_model``."""

    def __init__(self, config: LaunchConfig, factory: RecorderFactory) -> None:
        self.config, self.factory = config, factory
        self.runners: set[int] = set()

    def attach(self, runner: Any) -> None:
        """Record ``runner``; any failure is one warning naming it, and the trace says it stopped."""
        from tracediff.integrations.vllm.facts import PRODUCER
        from tracediff.integrations.vllm.guard import SUPPORTED_VLLM, supported, vllm_version

        if id(runner) in self.runners:
            return
        self.runners.add(id(runner))
        rec = None
        try:
            rank, world = _rank()
            # the run's facts in the opening metadata too: a worker SIGKILLed before its close (vLLM's
            # default shutdown) leaves a trace that still states its engine, config and aux ids
            rec = self.factory(rank, world, source="serving", meta=_opening_facts(runner))
            if not rec.active:
                return
            version = vllm_version()
            if not supported(version):
                why = (f"vLLM {version} is not a version tracediff records ({', '.join(SUPPORTED_VLLM)}); "
                       "the server runs unrecorded")
                logger.warning("tracediff: %s", why)
                rec.update_contract(source="serving", vllm_version=version)
                rec.stop_producer(PRODUCER, why)
                return
            graphs = _cuda_graphs(runner)
            if graphs:
                logger.warning("tracediff: not recording vLLM: %s", graphs)
                rec.update_contract(source="serving", vllm_version=version)
                rec.stop_producer(PRODUCER, graphs)
                return
            from tracediff.integrations.vllm.hooks import install

            install(rec, runner, requests=self.config.requests, match_prefix=self.config.match_prefix)
            _close_first(self.factory)
        except Exception as exc:
            why = f"cannot attach to {type(runner).__qualname__} ({type(exc).__name__}: {exc})"
            logger.warning("tracediff: not recording vLLM: %s; the server runs as usual", why)
            if rec is not None:
                rec.stop_producer(PRODUCER, why)

    def patch(self, module: Any, name: str) -> None:
        cls = getattr(module, name, None)
        if cls is None or getattr(cls.__dict__.get("load_model"), "_tracediff", False):
            return
        original = cls.__dict__.get("load_model")
        if original is None:  # inherited: wrapping the base's wraps this class too
            return

        def load_model(runner: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(runner, *args, **kwargs)
            self.attach(runner)
            return result

        load_model._tracediff = True  # type: ignore[attr-defined]
        cls.load_model = load_model

    def watch(self) -> None:
        for module, name in RUNNERS:
            when_imported(module, functools.partial(self.patch, name=name))


_plugin: _Plugin | None = None


def at_startup(config: LaunchConfig, recorder: RecorderFactory) -> None:
    """In every process of ``tracediff record``: record each vLLM runner this process loads."""
    global _plugin
    try:
        if _plugin is None:
            _plugin = _Plugin(config, recorder)
            _plugin.watch()
    except Exception as exc:
        logger.warning("tracediff: the vLLM plugin did not start (%s: %s); nothing is recorded",
                       type(exc).__name__, exc)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point, called in every vLLM process: nothing unless this
    process runs under ``tracediff record`` with the vLLM plugin."""
    if not os.environ.get(ENV):
        return
    try:
        from tracediff.record import child

        child.startup()  # a no-op where the launcher's sitecustomize already ran it
        if _plugin is not None:
            _plugin.watch()
    except Exception as exc:
        logger.warning("tracediff: the vLLM plugin did not start (%s: %s); nothing is recorded",
                       type(exc).__name__, exc)


def _opening_facts(runner: Any) -> dict[str, Any]:
    """``facts.run_facts`` of the runner, or {} where a changed internal keeps them from being read
    (``install`` then says which)."""
    try:
        from tracediff.integrations.vllm.facts import run_facts

        return run_facts(runner)
    except Exception:
        return {}


def _close_first(factory: RecorderFactory) -> None:
    """vLLM's worker turns SIGINT and SIGTERM into ``SystemExit``, and its API server SIGKILLs the
    worker's process tree moments later (a Ctrl-C reaches every process at once): close this
    process's trace first, inside the signal handler, then hand the signal to vLLM's handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    close = getattr(factory, "close", None)
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)
        if not callable(previous) or getattr(previous, "_tracediff", False) or close is None:
            continue

        def handler(num: int, frame: Any, previous: Any = previous) -> None:
            try:
                close()
            except BaseException:  # a close cut short must not keep vLLM from stopping
                pass
            previous(num, frame)

        handler._tracediff = True  # type: ignore[attr-defined]
        signal.signal(signum, handler)


def _cuda_graphs(runner: Any) -> str | None:
    """Why hooks would miss steps: a CUDA runner replaying CUDA graphs (its forwards fire no hook)."""
    device = getattr(getattr(runner, "device", None), "type", None)
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    if device == "cuda" and mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        return ("vLLM replays CUDA graphs, where hooks never fire: serve with --enforce-eager to record")
    return None


def _rank() -> tuple[int | None, int | None]:
    try:
        from vllm.distributed import parallel_state

        group = parallel_state.get_tp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:
        return None, None
