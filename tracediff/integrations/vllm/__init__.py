"""Recording vLLM's EAGLE-3 serving path (target, draft, verify) under canonical names.

``install(recorder, runner)`` attaches to one loaded V1 model runner (in-process: an offline ``LLM``
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or ``LLM.collective_rpc``); ``tracediff record -- vllm serve
...`` attaches in every worker through vLLM's plugin entry point (plugin.py). Rows are keyed by content
at each step's end, once its tokens are committed (steps.py): (request, position, the request's token
there), as docs/FORMAT.md says for every producer.

Modules: ``guard`` (supported versions, the internals read), ``steps`` (row keys of a step), ``hooks``
(what ``install`` attaches; where each tensor comes from), ``facts`` (what the trace states about the
run), ``aux_reading`` (the states vLLM feeds for a draft's aux ids), ``plugin`` (the launcher's and
vLLM's entry), ``producer`` (what the launcher and the CLI know of vLLM).
"""

from tracediff.integrations.vllm.guard import SUPPORTED_VLLM, VllmInternalsError
from tracediff.lazy import lazy

# loaded on first use: the CLI and the launcher import this package (its producer) without the hooks
__getattr__ = lazy(__name__, {"Installation": ".hooks", "install": ".hooks", "at_startup": ".plugin",
                              "register": ".plugin"})

__all__ = ["SUPPORTED_VLLM", "Installation", "VllmInternalsError", "at_startup", "install", "register"]
