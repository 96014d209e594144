"""What ``tracediff record`` shares with the processes it runs and with the producers: the config it
hands every process (``LaunchConfig``, in ``TRACEDIFF_LAUNCH``), the request gate plugins apply, and
what the launcher asks of a producer (``LaunchPlugin``; integrations/producer.py's ``Producer`` adds what
the rest of tracediff asks of it).

Standard library only (and the ground floor's JSON codec): the CLI imports this at start, and every
recorded process at its start-up.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tracediff.jsonio import from_plain, to_plain

if TYPE_CHECKING:
    from tracediff.record.recorder import Recorder

ENV = "TRACEDIFF_LAUNCH"  # the environment variable holding the LaunchConfig
RecorderFactory = Callable[..., "Recorder"]  # a plugin's recorder: opens this process's file on first call


def never(config: LaunchConfig, command: Sequence[str]) -> str | None:
    """A producer that refuses (or advises) nothing before start."""
    return None


@dataclass(frozen=True)
class LaunchPlugin:
    """A producer as ``tracediff record -- CMD`` sees it."""

    name: str
    plugin: str  # the module whose ``at_startup(config, recorder)`` runs in every process of the child
    claims: Callable[[LaunchConfig, Sequence[str]], bool]  # whether its plugin is needed for this run
    refuse: Callable[[LaunchConfig, Sequence[str]], str | None] = never  # why the run would be pointless
    silent_hint: str | None = None  # a likely cause when a run with its plugin wrote no file
    advise: Callable[[LaunchConfig, Sequence[str]], str | None] = never  # a note printed at start


@dataclass(frozen=True)
class LaunchConfig:
    """What ``tracediff record`` asks every process of the child tree to record."""

    out: str  # the --out path
    plugins: tuple[str, ...]  # modules with at_startup(config, recorder)
    watch: tuple[str, ...] = ()  # --watch module globs
    names: tuple[str, ...] = ()  # --names / --exclude globs, --every N: passed to the Recorder
    exclude: tuple[str, ...] = ()
    every: int = 1
    requests: int | None = None  # --requests N: record only the first N requests seen
    match_prefix: tuple[int, ...] | None = None  # --match-prefix 1,2,3: only requests whose tokens start so
    eager_only: bool = False  # --eager-only: a trace of the eager forwards alone is what is wanted
    queue_bytes: int | None = None  # --queue-bytes: each recorder's queue (None: the Recorder's default)
    on_full: str = "drop"  # --on-full: what a recorder does when its queue is full (drop or block)

    def to_env(self) -> str:
        return json.dumps(to_plain(self))

    @classmethod
    def from_env(cls, text: str) -> LaunchConfig:
        """The config ``to_env`` wrote (the same tracediff runs on both sides): ValueError for any other."""
        return from_plain(cls, json.loads(text))


@dataclass
class RequestGate:
    """--requests N and --match-prefix for plugins: admits the first N requests seen whose tokens
    start with the prefix; a request's answer never changes once given."""

    limit: int | None
    prefix: tuple[int, ...] | None
    admitted: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    count: int = 0  # requests admitted so far (finished ones forgotten included)

    @classmethod
    def of(cls, config: LaunchConfig) -> RequestGate:
        return cls(config.requests, config.match_prefix)

    @property
    def active(self) -> bool:
        return self.limit is not None or self.prefix is not None

    def admit(self, request: str, tokens: Sequence[int] | None = None) -> bool:
        """Whether to record ``request``, decided at its first sight from its first tokens."""
        if request in self.admitted:
            return True
        if request in self.refused:
            return False
        ok = self.limit is None or self.count < self.limit
        if ok and self.prefix is not None:
            head = [int(t) for t in list(tokens or [])[: len(self.prefix)]]
            ok = head == list(self.prefix)
        (self.admitted if ok else self.refused).add(request)
        self.count += ok
        return ok

    def forget(self, request: str) -> None:
        """A finished request: its answer is no longer needed (the count of admitted ones stays)."""
        self.admitted.discard(request)
        self.refused.discard(request)


__all__ = ["ENV", "LaunchConfig", "LaunchPlugin", "RecorderFactory", "RequestGate", "never"]
