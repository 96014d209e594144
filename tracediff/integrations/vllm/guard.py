"""Which vLLM tracediff records, and the internals it reads there, checked before anything attaches.

A vLLM whose version is not in ``SUPPORTED_VLLM`` is not recorded (one warning; the server runs as
usual, and the trace says why it holds nothing): its runner's internals change between releases, and
a hook that silently fires in the wrong place would write a trace that lies. ``check_runner`` names
the first internal the hooks need that a runner lacks (``VllmInternalsError``).
"""

from __future__ import annotations

from typing import Any

from tracediff.eagle3.versions import VLLM_VERSION

SUPPORTED_VLLM = (VLLM_VERSION,)  # eagle3/versions.py


class VllmInternalsError(RuntimeError):
    """A vLLM internal the recorder reads is missing or changed (names which)."""


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "not installed"


def supported(version: str) -> bool:
    """0.32.0 and its local builds (``0.32.0+cpu``)."""
    return version.split("+", 1)[0] in SUPPORTED_VLLM


# what the hooks read, by where: (object path from the runner, attribute)
_RUNNER = ("model", "input_batch", "query_start_loc", "requests", "execute_model", "sample_tokens")
_TARGET = ("compute_logits", "forward")
_DRAFTER = ("model", "propose", "set_inputs_first_pass")
_DRAFT = ("combine_hidden_states", "compute_logits", "logits_processor", "forward")


def check_runner(runner: Any) -> None:
    """Raise ``VllmInternalsError`` naming the first internal the hooks need that is missing."""
    def need(obj: Any, where: str, names: tuple[str, ...]) -> None:
        for name in names:
            if not hasattr(obj, name):
                raise VllmInternalsError(f"{where}.{name} is missing ({type(obj).__qualname__})")

    need(runner, "runner", _RUNNER)
    need(runner.input_batch, "runner.input_batch", ("req_ids",))
    need(runner.query_start_loc, "runner.query_start_loc", ("cpu",))
    need(runner.model, "runner.model", _TARGET)
    body = getattr(runner.model, "model", None)
    if body is None or not hasattr(body, "layers"):
        raise VllmInternalsError(f"runner.model.model.layers is missing ({type(runner.model).__qualname__})")
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and getattr(drafter, "method", None) == "eagle3":
        need(drafter, "runner.drafter", _DRAFTER)
        need(drafter.model, "runner.drafter.model", _DRAFT)
