"""Every producer tracediff knows, one line each: the launcher and the CLI ask this, never a name.

Adding a producer: its folder under ``tracediff/integrations/`` with a ``producer.py`` defining a
``Producer`` (``producer.py`` here says what it holds), and one line below.
"""

from __future__ import annotations

from tracediff.integrations.producer import Producer
from tracediff.integrations.sglang.producer import PRODUCER as SGLANG
from tracediff.integrations.specforge.producer import PRODUCER as SPECFORGE
from tracediff.integrations.torch_watch.producer import PRODUCER as TORCH_WATCH
from tracediff.integrations.vllm.producer import PRODUCER as VLLM

PRODUCERS: tuple[Producer, ...] = (
    TORCH_WATCH,
    SGLANG,
    SPECFORGE,
    VLLM,
)

__all__ = ["PRODUCERS"]
