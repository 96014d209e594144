"""``tracediff.doctor``: everything the ``doctor`` command does, as one library call returning a typed
``DoctorReport``: what a draft checkpoint means to each engine, before it is served (eagle3/doctor.py
holds the checks).

    >>> import tracediff as td                                                        # doctest: +SKIP
    >>> report = td.doctor("draft_dir", target="target_dir")                          # doctest: +SKIP
    >>> [f.code for f in report.errors]                                               # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tracediff.eagle3.vocab import Finding


@dataclass(frozen=True)
class DoctorReport:
    """Every finding about one draft checkpoint, errors first (then warnings, then notes)."""

    findings: tuple[Finding, ...]

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def exit_code(self) -> int:
        """The command's: 1 when an error is found, else 0."""
        return 1 if self.errors else 0

    def to_list(self) -> list[dict[str, str]]:
        """``tracediff doctor --json``: one object per finding (severity, code, message, fix)."""
        return [vars(f) for f in self.findings]


def doctor(draft: str | Path, *, target: str | Path | None = None, server_args: str | None = None
           ) -> DoctorReport:
    """Check draft checkpoint ``draft`` against its ``target`` (its config.json) and the serving
    command's speculative arguments (``server_args``, e.g. ``"--speculative-num-steps 3"``). Raises
    ``InputError`` (``CheckpointError``) when the files cannot be read."""
    from tracediff.eagle3.doctor import doctor as findings_of

    return DoctorReport(tuple(findings_of(draft, target, server_args)))
