"""The ``tracediff`` command line. Thin: parse, call one function per command, render."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

from tracediff.errors import InputError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Record, replay and diff tensor traces of EAGLE-3 speculative decoding.")
# Piped output (files, CI logs, bug reports) gets wide lines instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 200)


def fail(path: str | Path, problem: str) -> None:
    """One line on stderr, exit 2: the contract for every bad input."""
    print(f"error: {path}: {problem}", file=sys.stderr)
    raise typer.Exit(2)


def guarded(path: str | Path, action: Callable[[], None]) -> None:
    try:
        action()
    except InputError as exc:
        fail(exc.path, exc.problem)


@app.command()
def show(
    trace: Path = typer.Argument(..., help="trace file (.h5 / .arrow), or the stem of per-rank files"),
    name: str | None = typer.Option(None, "--name", "-n", help="print stats and values of this tensor"),
    step: int | None = typer.Option(None, help="with --name: only this step"),
    request: str | None = typer.Option(None, help="with --name: only this request"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Metadata and the tensors of a trace, in execution order; or stats of one tensor."""
    from tracediff.report.show import render_stats, render_summary
    from tracediff.trace.reader import open_trace
    from tracediff.trace.summary import summarize, tensor_stats

    def run() -> None:
        with open_trace(trace) as opened:
            if name is None:
                summary = summarize(opened)
                if as_json:
                    print(json.dumps(summary.to_dict(), indent=1))
                else:
                    render_summary(console, summary)
                return
            where = " ".join(f"{k}={v}" for k, v in (("step", step), ("request", request)) if v is not None)
            try:
                stats = tensor_stats(opened.rows(name, step=step, request=request))
            except KeyError:
                fail(trace, f"no rows of tensor {name!r} {where}".rstrip() + " (list: tracediff show)")
            if as_json:
                print(json.dumps(stats.to_dict(), indent=1))
            else:
                render_stats(console, stats, where)

    guarded(trace, run)


@app.command()
def convert(
    src: Path = typer.Argument(..., help="trace to read"),
    dst: Path = typer.Argument(..., help="trace to write; the format follows the extension"),
) -> None:
    """Convert a trace between HDF5 and Arrow without loss."""
    from tracediff.trace.convert import convert as run_convert
    from tracediff.trace.writer import format_for

    if dst.exists() and dst.resolve() == src.resolve():
        fail(dst, "output would overwrite the input")
    try:
        format_for(dst)
    except ValueError as exc:
        fail(dst, str(exc).split(": ", 1)[-1])
    guarded(src, lambda: console.print(f"wrote {', '.join(map(str, run_convert(src, dst)))}"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
